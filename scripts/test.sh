#!/usr/bin/env bash
# Install kvshm with its test extras and run the whole test suite.
# Extra arguments go to pytest.  KVSHM_STRESS_EXAMPLES=N lengthens the
# randomized invariant tests (default: a bounded run that suits CI).
set -euo pipefail
KVSHM_EXTRAS=test
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"
cd "$REPO"
set +e
"$VENV/bin/python" -m pytest "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: failing on purpose" >&2
  exit 1
fi
exit "$status"
