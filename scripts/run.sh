#!/usr/bin/env bash
# The main job: set up kvshm on first use, then run `kvshm demo` (a pool, a
# synthetic multi-request workload, a pool check and the conformance replay).
# Extra arguments go to `kvshm demo` (see `kvshm demo --help`).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
exec "$VENV/bin/kvshm" demo "$@"
