#!/usr/bin/env bash
# The prepared GPU run (issue 47), about 8 minutes on one H100/H200, no network needed:
#   1. rlhf-torchrl bench real_sizes: a device profile, then for Qwen2.5-0.5B's and 1.5B's
#      shapes (random inits of rlhf_torchrl/benchmarks/model_configs/*.json) the floor of the
#      run's shapes and the PPO recipe at verl's quickstart settings in bf16: seconds per phase,
#      tokens/s, MFU, peak GPU memory -> $OUT/real_sizes.json. By default (REAL_SIZES_ARGS
#      unset) what the lent H200 of 2026-11-28 did not measure comes first: at 0.5B the floor,
#      eager and the bf16x3 LM head; then `rlhf-torchrl plan` of the 0.5B and 1.5B eager runs
#      on this GPU (its seconds timed on one-layer copies there: the plan against the runs);
#      then 0.5B's compiled generation and FSDP2, and 1.5B's bf16x3 head
#   2. the GPU tests (python -m pytest -m gpu), log -> $OUT/gpu_tests.log
# Each step has a deadline and writes what it measured as it goes: a run cut short keeps it.
#
#   bash benchmarks/gpu.sh OUTDIR
#
# On a machine without this project's dependencies (the lent GPU has torch and transformers
# only), the wheels in .whl/ are installed to /tmp/site first, and SmolLM2's tokenizer is read
# from .gpucache/ (RLHF_TORCHRL_CACHE; the tests and the benchmark need only its tokenizer):
# benchmarks/gpu_prepare.sh makes both here; the device tool carries them (carry: .whl, .gpucache).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-outputs/gpu}
mkdir -p "$OUT"
if [ -d .whl ] && ! python3 -c "import torchrl" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .gpucache ] && export RLHF_TORCHRL_CACHE="$PWD/.gpucache"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"

start=$(date +%s)
DEFAULT_STEPS="--steps qwen2.5-0.5b:floor qwen2.5-0.5b:eager qwen2.5-0.5b:bf16x3 qwen2.5-0.5b:plan qwen2.5-1.5b:plan qwen2.5-0.5b:compiled qwen2.5-0.5b:fsdp2 qwen2.5-1.5b:bf16x3"
timeout "${REAL_SIZES_TIMEOUT:-420}" python3 -m rlhf_torchrl.cli bench real_sizes \
    --out "$OUT/real_sizes.json" ${REAL_SIZES_ARGS-$DEFAULT_STEPS} 2>&1 | tee "$OUT/real_sizes.log"
echo "real_sizes: $(( $(date +%s) - start )) s"

start=$(date +%s)
timeout "${GPU_TESTS_TIMEOUT:-90}" python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu.py \
    2>&1 | tee "$OUT/gpu_tests.log" | tail -n 15
echo "GPU tests: $(( $(date +%s) - start )) s"
