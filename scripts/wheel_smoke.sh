#!/usr/bin/env bash
# braid as its users get it: build the sdist and, from it, the wheel; check both hold every file of
# the package; install the wheel into a fresh virtual environment (its own torch, no checkout on
# the path) and run scripts/wheel_smoke.py there from a folder outside the checkout: import,
# `braid --version`, `braid env`, `braid sim` on its shipped data, and a 2-rank CPU world under
# init_process_group("braid"). Fails on the first thing wrong. 1.5 minutes on 2 cores, half of it
# torch's install; the torch pin is BRAID_SMOKE_TORCH (default: this Python's torch, else 2.13.0).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PYTHON:-python3}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/braid-wheel-smoke.XXXXXX")"
trap 'rm -rf "$WORK"' EXIT
start=$SECONDS
step() { echo "wheel smoke: $* ($((SECONDS - start)) s)"; }
pip_q() { "$@" 2>&1 | { grep -v "^WARNING: Location .* is ignored" || true; }; }   # status kept (pipefail)

TORCH_SPEC="${BRAID_SMOKE_TORCH:-torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null || echo 2.13.0)}"

step "building the sdist and the wheel"
"$PY" -m venv "$WORK/tools"
pip_q "$WORK/tools/bin/python" -m pip install -q build
# the sdist from the checkout, then the wheel from the unpacked sdist (a file the sdist lacks is then
# missing from the wheel too, and the check below names it)
(cd "$WORK" && "$WORK/tools/bin/python" -m build --outdir "$WORK/dist" "$ROOT" > "$WORK/build.log" 2>&1) \
    || { tail -40 "$WORK/build.log"; echo "wheel smoke: FAIL: the build failed" >&2; exit 1; }
"$PY" "$ROOT/scripts/wheel_smoke.py" contents "$WORK/dist" "$ROOT/src"

step "installing the wheel and $TORCH_SPEC into a fresh venv"
"$PY" -m venv "$WORK/venv"
pip_q "$WORK/venv/bin/python" -m pip install -q --no-compile "$TORCH_SPEC" "$WORK"/dist/*.whl

step "running from a folder outside the checkout"
mkdir "$WORK/run" && cp "$ROOT/scripts/wheel_smoke.py" "$WORK/run/"
(cd "$WORK/run" && env -u PYTHONPATH -u PYTHONHOME PYTHONNOUSERSITE=1 CUDA_VISIBLE_DEVICES= \
    BRAID_CACHE_DIR="$WORK/cache" BRAID_TIMEOUT_S=60 OMP_NUM_THREADS=1 \
    "$WORK/venv/bin/python" -I wheel_smoke.py run)
step "done"
