#!/usr/bin/env bash
# The main job: set up kvshm on first use, then run `kvshm run`: a coordinator
# and pinned CPU workers sharing one KV pool and arena on a synthetic workload,
# with live progress and a summary.  Extra arguments go to `kvshm run` (see
# `kvshm run --help`), e.g. --workers 4 --duration 60 --compare.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$VENV/bin/kvshm" run "$@"
