#!/usr/bin/env bash
# One prepared command for a lent GPU machine (sized for one H200, <= 8 minutes wall): calibrate the GPU, run
# the CUDA paths of the transfer tests, then cross-check the simulator against measured decodes of
# random:qwen2-7b (DeepSeek-R1-Distill-Qwen-7B shapes, random bf16 weights created on the GPU) with full,
# evict and hierarchy at two HBM budgets, on the calibrated profile and on the datasheet profile (h200-sxm).
#
# Installs nothing: it runs the repo from PYTHONPATH under the machine's own python3 (torch + transformers
# there). The one package such images lack, simpy (pure Python, the simulator's engine), is taken from
# build/devdeps/ when present; prepare it here and carry it:
#     mkdir -p build/devdeps && cp -r .venv/lib/python3.11/site-packages/simpy build/devdeps/
#     device run: command "OUT=$OUT bash tests/gpu/crosscheck_on_device.sh", carry ["build/devdeps"]
#
# Writes under $OUT (at most 8 files, none in subfolders): log.txt, measured-cuda.yaml (the calibrated
# profile), summary.json, summary.csv, steps.csv, scatter.png, crosscheck.tgz (every trace and timing).
set -uo pipefail
OUT=${OUT:?set OUT to the output directory}
PYTHON=${PYTHON:-python3}
STEPS=${STEPS:-256}
REPEATS=${REPEATS:-2}
export PYTHONPATH="$PWD:$PWD/build/devdeps${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
WORK=$(mktemp -d)
mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1

phase() { echo; echo "== $(date -u +%T) $*"; }
status=0

phase "environment"
nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv || true
$PYTHON - <<'EOF' || exit 1
import importlib, torch
assert torch.cuda.is_available(), "no CUDA device visible to torch"
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
for name in ("transformers", "simpy", "pandas", "pyarrow", "yaml", "matplotlib", "tqdm"):
    module = importlib.import_module(name)
    print(name, getattr(module, "__version__", "?"))
EOF

phase "calibrate (microbenchmarks -> profile)"
timeout 180 $PYTHON -m thoughtkv calibrate --device cuda --out "$WORK/measured-cuda.yaml" --force || status=1
cp "$WORK/measured-cuda.yaml" "$OUT/" 2>/dev/null || true

phase "CUDA paths of the DDR tier's data movement (the mapped pinned pool, gathers and scatters by (row, block))"
timeout 90 $PYTHON -m pytest -q -p no:cacheprovider tests/test_calibrate_transfer.py || status=1

phase "crosscheck random:qwen2-7b: measured decodes vs simulator"
if [ -f "$WORK/measured-cuda.yaml" ]; then
  timeout 300 $PYTHON -m thoughtkv crosscheck --model random:qwen2-7b --device cuda \
    --policy full evict hierarchy --hbm-budget 0.5 0.25 --steps "$STEPS" --repeats "$REPEATS" \
    --profile "$WORK/measured-cuda.yaml" --datasheet-profile auto --out "$WORK/crosscheck" --quiet || status=1
  for f in summary.json summary.csv steps.csv scatter.png; do cp "$WORK/crosscheck/$f" "$OUT/" 2>/dev/null || true; done
  tar czf "$OUT/crosscheck.tgz" -C "$WORK" crosscheck measured-cuda.yaml 2>/dev/null || true
else
  echo "no calibrated profile: crosscheck skipped"; status=1
fi

phase "done (status $status)"
exit $status
