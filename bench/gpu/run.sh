#!/usr/bin/env bash
# The dream stage on a CUDA GPU vs the CPU, without Python (compiled and run
# on CPU only so far: 2026-11-29, identical losses, chunked loss within 1e-6).
# Prepare a directory holding this file, CMakeLists.txt, dream_gpu_check.cpp,
# tree/ (the materialized, patched vendor/llama.cpp without .git, docs, tools,
# tests and the non-CUDA backends: about 25 MB), ggml_ext/ (a copy of
# dreamstage/ggml_ext) and tiny.gguf (tests/tiny_model.write_tiny_model), copy
# it to the GPU machine and run it there.
set -euo pipefail
cd "$(dirname "$0")"
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null 2>&1 || \
  cmake -S . -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 >/dev/null
cmake --build build --target dream_gpu_check -j 16 2>&1 | grep -E "error|Error" | head -20 || true
./build/bin/dream_gpu_check tiny.gguf 2>/dev/null || LD_LIBRARY_PATH=build/bin ./build/dream_gpu_check tiny.gguf
