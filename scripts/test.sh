#!/usr/bin/env bash
# Install kvshm with its test extras, and vLLM's CPU build with kvshm in a
# second environment (.venv-vllm, reused when it is there: see vllm_env.sh),
# then run the whole test suite; the vLLM engine tests must run, not skip.
# Extra arguments go to pytest.  KVSHM_STRESS_EXAMPLES=N lengthens the
# randomized invariant tests (default: a bounded run that suits CI).
set -euo pipefail
KVSHM_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO"
KVSHM_VLLM_PYTHON=$(./scripts/vllm_env.sh | tail -n 1)
export KVSHM_VLLM_PYTHON KVSHM_REQUIRE_VLLM=1
set +e
"$VENV/bin/python" -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$status"
