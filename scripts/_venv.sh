# Sourced by run.sh and test.sh: create or refresh the project's virtual
# environment (.venv, or $KVSHM_VENV) with Python >= 3.11 and install kvshm
# into it, with the extras named in $KVSHM_EXTRAS.  Re-installs only when
# pyproject.toml or the extras change.
set -euo pipefail
# -P: the real repository, also when scripts/ is reached through a symlink
# (the README test runs it so, and an editable install must not point there).
REPO=$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VENV=${KVSHM_VENV:-$REPO/.venv}
EXTRAS=${KVSHM_EXTRAS:-}

pick_python() {
  for py in ${PYTHON:-} python3.13 python3.12 python3.11 python3; do
    if command -v "$py" >/dev/null 2>&1 &&
       "$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
      echo "$py"; return 0
    fi
  done
  echo "kvshm needs Python >= 3.11 (set PYTHON=/path/to/python3.11)" >&2
  return 1
}

# An editable install of kvshm into $VENV.  It writes kvshm.egg-info/ and
# build/ in the repository, so two installs at once (test.sh installs both
# vLLM environments together) take turns: flock on pyproject.toml, a file
# every checkout has.
install_kvshm() {
  flock "$REPO/pyproject.toml" \
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$1"
}

if [ ! -x "$VENV/bin/python" ]; then
  PY=$(pick_python)
  echo "creating virtual environment $VENV ($("$PY" --version))" >&2
  "$PY" -m venv "$VENV"
fi
stamp="$VENV/.kvshm-installed"
sum=$(cksum < "$REPO/pyproject.toml")
want="$sum extras=[$EXTRAS]"
have=$(cat "$stamp" 2>/dev/null || true)
# Up to date when pyproject.toml is unchanged and the installed extras
# include the ones asked for (the test extras serve run.sh too).
if [ "$have" != "$want" ] && ! { [ -z "$EXTRAS" ] && [ "${have% extras=*}" = "$sum" ]; }; then
  spec="$REPO"
  [ -n "$EXTRAS" ] && spec="$REPO[$EXTRAS]"
  echo "installing kvshm${EXTRAS:+[$EXTRAS]} into $VENV" >&2
  install_kvshm "$spec"
  echo "$want" > "$stamp"
fi
