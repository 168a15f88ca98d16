#!/usr/bin/env bash
# Everything the GPU benches carry to the device machine, made from a set-up checkout
# (after ./dev.sh build) in one command:
#   .gpu/llama.cpp          the patched tree trimmed to what the CUDA build and llama-server need
#   .gpu/tokenizer_kv.json  the default model's tokenizer, for make_model.py's random models
#   .gpu/tiny-llama-*.gguf  the tests' tiny models (f32, q8_0) for dream_gpu_check and soft_check
#   .gpu/site               gguf and the llama_cpp bindings (pure Python; the libraries are built there)
#   .whl                    the server's and the anchors' wheels (fetch_wheels.sh; liger-kernel for peft_bench --liger)
# Then, on the device machine (carry .gpu/llama.cpp .gpu/site .gpu/tokenizer_kv.json .gpu/*.gguf .whl):
#   bash bench/gpu/run.sh OUT check,bench,peft
#   bash bench/gpu/prepare.sh [VENV=.venv]
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${1:-.venv}
PY="$VENV/bin/python"
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
mkdir -p .gpu/site
"$PY" bench/gpu/trim_tree.py --server
[ -s .gpu/tokenizer_kv.json ] || "$PY" bench/gpu/make_model.py --dump-tokenizer .gpu/tokenizer_kv.json
"$PY" -c 'import sys; sys.path.insert(0, "tests"); from pathlib import Path; from tiny_model import write_tiny_model
for q in ("f32", "q8_0"): print(write_tiny_model(Path(".gpu"), quant=q))'
rm -rf .gpu/site/gguf .gpu/site/llama_cpp
cp -r "$SITE/gguf" .gpu/site/
cp -r "$SITE/llama_cpp" .gpu/site/ && rm -rf .gpu/site/llama_cpp/lib
find .gpu/site -name __pycache__ -prune -exec rm -rf {} +
bash bench/gpu/fetch_wheels.sh "$VENV"
"$PY" -m pip download -q --no-deps --only-binary=:all: -d .whl/liger liger-kernel==0.8.5
du -sh .gpu .whl
