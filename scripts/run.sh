#!/usr/bin/env bash
# The main job: set up kvshm on first use, then run `kvshm run`: a coordinator
# and pinned CPU workers sharing one KV pool and arena on a synthetic workload,
# with live progress and a summary.  With no arguments it answers "is the
# shared pool faster?": the same 80 requests on one shared pool, then on one
# private pool per worker, and the speedup (about half a minute on 2 cores).
# Arguments replace that and go to `kvshm run` (see `kvshm run --help`),
# e.g. --workers 4 --duration 60 --compare.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
if [ "$#" -eq 0 ]; then
  set -- --compare --requests 80 --duration 300
fi
exec "$VENV/bin/kvshm" run "$@"
