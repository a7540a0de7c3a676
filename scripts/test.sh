#!/usr/bin/env bash
# Install kvshm with its test extras, and vLLM's CPU builds with kvshm in two
# more environments (.venv-vllm for vLLM 0.14.0, .venv-vllm-0.32.0 for
# 0.32.0, each reused when it is there: see vllm_env.sh), then run the whole
# test suite; the vLLM tests must run, not skip.
#
#   ./scripts/test.sh                 # everything
#   ./scripts/test.sh tests/test_x.py -k name    # extra arguments go to pytest
#
# With no arguments the vLLM environments install in the background, both
# at once, while every other test runs (niced once the serial tests
# start), then tests/test_vllm.py and tests/test_vllm_032.py run on them: a
# first run takes minutes less.  Each suite runs in two parts: the tests not
# marked `serial` on one pytest-xdist process per CPU (at most 4;
# KVSHM_TEST_PROCESSES=N sets it, 0 runs them in pytest's own process), then
# the `serial` ones alone (pyproject.toml says what the mark is for).
# KVSHM_STRESS_EXAMPLES=N lengthens the randomized invariant tests (default:
# a bounded run that suits CI).
set -euo pipefail
KVSHM_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO"
export KVSHM_REQUIRE_VLLM=1
# The subprocesses the tests start (coordinators, workers, CLIs: hundreds)
# import kvshm from this tree; where PYTHONDONTWRITEBYTECODE is set, each
# would compile it again (0.2 s of CPU a process here, about 12% of a
# subprocess-heavy test's CPU time).  The bytecode goes to __pycache__/.
unset PYTHONDONTWRITEBYTECODE

# pytest's exit status, with 5 (nothing collected) made a failure, unless
# the first argument is --may-collect-none.
run_pytest() {
  local status=0 none_ok=0
  if [ "${1:-}" = "--may-collect-none" ]; then none_ok=1; shift; fi
  "$VENV/bin/python" -m pytest "$@" || status=$?
  if [ "$status" -eq 5 ]; then
    [ "$none_ok" -eq 1 ] && return 0
    echo "pytest collected no tests: failing on purpose" >&2
    return 1
  fi
  return "$status"
}

VLLM_TESTS=(tests/test_vllm.py tests/test_vllm_032.py tests/test_vllm_host.py)
if [ "$#" -gt 0 ]; then
  KVSHM_VLLM_PYTHON=$(./scripts/vllm_env.sh | tail -n 1)
  KVSHM_VLLM_032_PYTHON=$(./scripts/vllm_env.sh 0.32.0 | tail -n 1)
  export KVSHM_VLLM_PYTHON KVSHM_VLLM_032_PYTHON
  run_pytest "$@"
  exit $?
fi

log=$(mktemp "${TMPDIR:-/tmp}/kvshm-vllm-env.XXXXXX")
log032=$(mktemp "${TMPDIR:-/tmp}/kvshm-vllm-032-env.XXXXXX")
# Both at once: each is mostly pip on one CPU or waiting on the network,
# and one after the other the second kept the vLLM tests waiting for minutes.
(./scripts/vllm_env.sh > "$log" 2>&1 & first=$!
 ./scripts/vllm_env.sh 0.32.0 > "$log032" 2>&1 & second=$!
 ok=0; wait "$first" || ok=1; wait "$second" || ok=1; exit "$ok") &
installer=$!

# The installs' processes: the background job and all it has started.
install_pids() {
  local pids=("$installer") i=0 child
  while [ "$i" -lt "${#pids[@]}" ]; do
    for child in $(ps -o pid= --ppid "${pids[$i]}" 2>/dev/null); do pids+=("$child"); done
    i=$((i + 1))
  done
  echo "${pids[@]}"
}
# At nice 15, with those they start from then on.
nice_installs() {
  # shellcheck disable=SC2046
  renice -n 15 -p $(install_pids) > /dev/null 2>&1 || true
}
# shellcheck disable=SC2046
trap 'kill $(install_pids) 2>/dev/null || true; rm -f "$log" "$log032"' EXIT
processes=${KVSHM_TEST_PROCESSES:-$(( $(nproc) < 4 ? $(nproc) : 4 ))}
status=0
run_pytest -n "$processes" -m "not serial" "${VLLM_TESTS[@]/#/--ignore=}" || status=$?
# The installs share the CPUs with the tests above (they are what the vLLM
# tests wait for: 5 minutes on a slow VM when niced throughout), but not
# with the serial tests' timed phases.
nice_installs
run_pytest -m serial "${VLLM_TESTS[@]/#/--ignore=}" || status=$?
if ! wait "$installer"; then
  echo "the vLLM environments did not install:" >&2
  tail -n 40 "$log" "$log032" >&2
  exit 1
fi
grep -h "^installed vLLM" "$log" "$log032" >&2 || true   # (nothing when reused)
KVSHM_VLLM_PYTHON=$(tail -n 1 "$log")
KVSHM_VLLM_032_PYTHON=$(tail -n 1 "$log032")
export KVSHM_VLLM_PYTHON KVSHM_VLLM_032_PYTHON
vllm_status=0
run_pytest -n "$processes" -m "not serial" "${VLLM_TESTS[@]}" || vllm_status=$?
# The vLLM tests marked serial, if any (none is now; the part above must
# collect tests).
run_pytest --may-collect-none -q -m serial "${VLLM_TESTS[@]}" || vllm_status=$?
[ "$status" -ne 0 ] && exit "$status"
exit "$vllm_status"
