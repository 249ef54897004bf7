#!/usr/bin/env bash
# The one command for a lent GPU machine (tests/gpu/README.md gives the exact `run` call; <= 9.5 min here, so
# that with a machine start it fits 12 minutes): install the carried wheels, probe the mapped pinned pool, then
#   1. tests/gpu/tracer_throughput.py: traced vs untraced tok/s, syncs per step, per-layer DDR recall/offload
#      on both ways of moving blocks (random:qwen2-7b initialised on the device; results written after each stage);
#   2. the crosscheck: calibrate the GPU (--quick), run the CUDA paths of the transfer tests, then measured
#      decodes of random:qwen2-7b (full, evict, hierarchy at two HBM budgets) against the simulator on the
#      calibrated profile and on the datasheet profile (h100-sxm / h200-sxm by the GPU's name).
# Each phase is bounded by `timeout`; the limits below add up to 570 s (the `run` call's timeout_s: 580). Every
# phase's output goes to stdout and to $OUT/log.txt as it comes (a `tee` per phase, which ends before the next one
# starts: nothing is lost at exit). PHASES (default: all four) runs some of them, e.g. a rerun of one that failed.
# Writes under $OUT (7 files, at most one folder down): log.txt, throughput/{throughput.json, layer_us.csv,
# log.txt}, measured-cuda.yaml, summary.json, crosscheck.tgz (steps.csv, summary.csv, scatter.png, the traces).
#
# SMOKE=1: every phase on a CPU with tiny sizes (tests/test_gpu_scripts.py; `make gpu-rehearsal` runs it under
# the device image's package versions). PYTHON: the interpreter (python3 there). WHEELS: the carried wheel
# folder (.gpu-wheels, made by `make gpu-rehearsal`), installed with pip --no-index into SITE.
set -uo pipefail
OUT=${OUT:?set OUT to the output directory}
PYTHON=${PYTHON:-python3}
WHEELS=${WHEELS:-.gpu-wheels}
SITE=${SITE:-/tmp/thoughtkv-site}
SMOKE=${SMOKE:-}
PHASES=${PHASES:-throughput calibrate tests crosscheck}
mkdir -p "$OUT"
LOG="$OUT/log.txt"
: >"$LOG"
WORK=$(mktemp -d)
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1  # (no progress bars in the log)
started=$SECONDS
status=0

say() { echo "$*" | tee -a "$LOG"; }
wanted() { [[ " $PHASES " == *" $1 "* ]]; }
phase() { say ""; say "== $* ($(date -u +%T), +$((SECONDS - started)) s)"; }
# bounded LIMIT_S COMMAND...: one phase's command under `timeout`, its output to stdout and the log as it comes
bounded() {
  local limit=$1
  shift
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && say "(stopped at its ${limit} s limit)"
  return "$rc"
}

if [ -n "$SMOKE" ]; then
  DEVICE=cpu MODEL=random:tiny
  THROUGHPUT_ARGS=(--prompt 96 --steps 6 --rounds 1 --batches 1,2 --write-steps 40 --budget-s 120)
  CALIBRATE_ARGS=(--smoke) CROSSCHECK_MODEL=tiny
  CROSSCHECK_ARGS=(--policy full hierarchy --hbm-budget 0.5 --steps 5 --repeats 2 --datasheet-profile h200-sxm)
  T_INSTALL=60 T_ENV=60 T_PROBE=60 T_THROUGHPUT=180 T_CALIBRATE=180 T_TESTS=300 T_CROSSCHECK=300
else
  DEVICE=cuda MODEL=random:qwen2-7b
  THROUGHPUT_ARGS=(--budget-s 150)  # (its defaults: prompt 512, 96 steps, 2 rounds, B = 1 and 16)
  CALIBRATE_ARGS=(--quick) CROSSCHECK_MODEL=random:qwen2-7b
  CROSSCHECK_ARGS=(--policy full evict hierarchy --hbm-budget 0.5 0.25 --steps 160 --repeats 2 --datasheet-profile auto)
  T_INSTALL=30 T_ENV=45 T_PROBE=30 T_THROUGHPUT=200 T_CALIBRATE=90 T_TESTS=60 T_CROSSCHECK=115
fi

phase "environment"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  bounded "$T_INSTALL" "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || status=1
  say "carried wheels: $(cd "$WHEELS" && ls ./*.whl | xargs -n1 basename | tr '\n' ' ')"
fi
export PYTHONPATH="$PWD:$SITE${PYTHONPATH:+:$PYTHONPATH}"
[ -n "$SMOKE" ] || nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
  --format=csv 2>&1 | tee -a "$LOG"
# (exit 1: no CUDA, nothing to run; exit 3: a package missing, noted, the phases that need it will say so)
bounded "$T_ENV" "$PYTHON" - "$DEVICE" <<'EOF'
import importlib, sys, torch
if sys.argv[1] == "cuda" and not torch.cuda.is_available():
    sys.exit("no CUDA device visible to torch")
print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda,
      torch.cuda.get_device_name(0) if sys.argv[1] == "cuda" else "cpu")
missing = []
for name in ("transformers", "huggingface_hub", "tokenizers", "safetensors", "numpy", "simpy", "pandas", "pyarrow",
             "yaml", "matplotlib", "tqdm", "rich", "pytest"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "?"), module.__file__)
    except ImportError as error:
        missing.append(name)
        print("MISSING", name, error)
from transformers import Qwen2ForCausalLM
from tracer.compat import cache_keyword
print("the model takes its cache as", cache_keyword(Qwen2ForCausalLM))
sys.exit(3 if missing else 0)
EOF
case $? in 0) ;; 3) status=1 ;; *) say "the environment cannot run the phases: stopped"; exit 1 ;; esac

phase "mapping probe (can kernels read and write the pinned DDR pool through its mapped view?)"
# In a process of its own: where a runtime maps no such memory, a kernel touching it faults and takes the process.
if ! bounded "$T_PROBE" "$PYTHON" -c "import sys, torch; from tracer.transfer import probe_mapping
probe = probe_mapping(torch.device('$DEVICE')); print(probe); sys.exit(0 if probe.mapped else 3)"; then
  export THOUGHTKV_DDR_COPY=copy-engine
  say "the DDR tier moves blocks by copies here: THOUGHTKV_DDR_COPY=copy-engine for every phase"
fi

if wanted throughput; then
  phase "throughput: traced vs untraced, syncs per step, DDR recall/offload per layer"
  mkdir -p "$OUT/throughput"
  OUT="$OUT/throughput" bounded "$T_THROUGHPUT" "$PYTHON" tests/gpu/tracer_throughput.py --device "$DEVICE" \
    --model "$MODEL" "${THROUGHPUT_ARGS[@]}" || status=1
fi

if wanted calibrate || wanted crosscheck; then  # (the crosscheck needs the calibrated profile)
  phase "calibrate (microbenchmarks -> profile)"
  bounded "$T_CALIBRATE" "$PYTHON" -m thoughtkv calibrate --device "$DEVICE" "${CALIBRATE_ARGS[@]}" \
    --out "$WORK/measured-$DEVICE.yaml" --force || status=1
  cp "$WORK/measured-$DEVICE.yaml" "$OUT/" 2>/dev/null || true
fi

if wanted tests; then
  phase "transfer tests (the DDR tier's data movement, on CUDA its mapped and copy-engine paths; recall-buffer hits from HBM)"
  bounded "$T_TESTS" "$PYTHON" -m pytest -q -p no:cacheprovider tests/test_calibrate_transfer.py \
    tests/test_recall_buffer_hbm.py || status=1
fi

if ! wanted crosscheck; then
  :
elif [ -f "$WORK/measured-$DEVICE.yaml" ]; then
  phase "crosscheck: measured decodes vs simulator"
  bounded "$T_CROSSCHECK" "$PYTHON" -m thoughtkv crosscheck --model "$CROSSCHECK_MODEL" --device "$DEVICE" \
    "${CROSSCHECK_ARGS[@]}" --profile "$WORK/measured-$DEVICE.yaml" --out "$WORK/crosscheck" --quiet || status=1
  cp "$WORK/crosscheck/summary.json" "$OUT/" 2>/dev/null || true
  tar czf "$OUT/crosscheck.tgz" -C "$WORK" crosscheck 2>/dev/null || true
  if [ "$(stat -c %s "$OUT/crosscheck.tgz" 2>/dev/null || echo 0)" -gt $((15 << 20)) ]; then  # (16 MiB a file)
    tar czf "$OUT/crosscheck.tgz" -C "$WORK" --exclude crosscheck/runs crosscheck && say "(traces left out: too big)"
  fi
else
  say "no calibrated profile: crosscheck skipped"
  status=1
fi

phase "done (status $status) in $((SECONDS - started)) s"
rm -rf "$WORK"
exit $status
