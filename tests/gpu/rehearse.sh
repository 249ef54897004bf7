#!/usr/bin/env bash
# `make gpu-rehearsal`: the lent GPU machine's Python environment, rehearsed here before a machine is spent on
# it (not part of `make test`; minutes the first time, when it builds the environment).
#   1. .gpu-rehearsal/: a virtual environment with the device image's package versions
#      (tests/gpu/device-image.txt says which, and where this machine must differ);
#   2. .gpu-wheels/: exactly the wheels the lent machine is given (tests/gpu/carried-wheels.txt), downloaded for
#      its Python (cp312, manylinux x86_64), with COMMIT (the commit they go with); its size is printed and
#      held to 40 MiB (what a call carries, the working tree included, is 64 MiB);
#   3. tests/gpu/on_device.sh in its smoke mode (every phase on a CPU), under that environment with only the
#      carried wheels added, installed as the device installs them (pip --no-index --no-deps --target);
#   4. the tests of what the device runs, under those versions: the cache keyword, the DDR tier's data
#      movement, the batched decode and its host syncs, the GPU scripts, the crosscheck.
# Prints how long it took.
set -euo pipefail
started=$SECONDS
cd "$(dirname "$0")/../.."
VENV=.gpu-rehearsal
WHEELS=.gpu-wheels
MAX_WHEELS_MIB=40
HOST_PYTHON=${REHEARSAL_PYTHON:-python3.11}  # the Python this machine has a CPU torch for (device-image.txt)
# pip, less the warnings of this machine's configured local indexes that lack a package
pip_() { "$@" 2>&1 | { grep -v 'is ignored: it is neither a file nor a directory' || true; }; }

if [ ! -f "$VENV/.installed" ] || [ tests/gpu/device-image.txt -nt "$VENV/.installed" ]; then
  echo "== $VENV: the device image's packages (tests/gpu/device-image.txt)"
  rm -rf "$VENV"
  "$HOST_PYTHON" -m venv "$VENV"
  pip_ "$VENV/bin/python" -m pip install -q -r tests/gpu/device-image.txt
  touch "$VENV/.installed"
fi
"$VENV/bin/python" -m pip list --format=freeze 2>/dev/null | grep -iE '^(torch|transformers|huggingface.hub|tokenizers|safetensors|numpy)=' \
  | tr '\n' ' '
echo

echo "== $WHEELS: the wheels the lent machine is given (tests/gpu/carried-wheels.txt)"
rm -rf "$WHEELS"
mkdir -p "$WHEELS"
pip_ "$HOST_PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d "$WHEELS" -r tests/gpu/carried-wheels.txt
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
git diff --quiet HEAD 2>/dev/null || commit="$commit (with uncommitted changes)"
echo "$commit" >"$WHEELS/COMMIT"
ls -l "$WHEELS"
wheels_bytes=$(du -sb "$WHEELS" | cut -f1)
echo "$WHEELS: $(awk "BEGIN {printf \"%.2f\", $wheels_bytes / 1048576}") MiB (limit $MAX_WHEELS_MIB MiB)"
if [ "$wheels_bytes" -gt $((MAX_WHEELS_MIB << 20)) ]; then
  echo "$WHEELS is over $MAX_WHEELS_MIB MiB: carry less (tests/gpu/carried-wheels.txt)" >&2
  exit 1
fi

SITE=$(mktemp -d)
OUT=$(mktemp -d)
trap 'rm -rf "$SITE" "$OUT"' EXIT
echo "== tests/gpu/on_device.sh, smoke mode, under $VENV + $WHEELS (output: $OUT)"
env -u PYTHONPATH -u THOUGHTKV_DDR_COPY OUT="$OUT" SMOKE=1 PYTHON="$VENV/bin/python" WHEELS="$WHEELS" SITE="$SITE" \
  OMP_NUM_THREADS=1 bash tests/gpu/on_device.sh >/dev/null || {
  tail -60 "$OUT/log.txt"
  echo "the device command failed in its smoke mode (log above)" >&2
  exit 1
}
grep -E '^(python|torch|transformers|simpy|the model takes) ' "$OUT/log.txt"
grep -E '^== done' "$OUT/log.txt"

echo "== the tests of what the device runs, under $VENV + $WHEELS"
env -u THOUGHTKV_DDR_COPY PYTHONPATH="$PWD:$SITE" OMP_NUM_THREADS=1 "$VENV/bin/python" -m pytest -q -p no:cacheprovider \
  tests/test_transformers_compat.py tests/test_calibrate_transfer.py tests/test_host_syncs.py tests/test_batched.py \
  tests/test_chunked_prefill.py tests/test_gpu_scripts.py tests/test_crosscheck.py tests/test_recall_buffer_hbm.py

echo "gpu-rehearsal passed in $((SECONDS - started)) s; carry $WHEELS ($(awk "BEGIN {printf \"%.2f\", $wheels_bytes / 1048576}") MiB)"
