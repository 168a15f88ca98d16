#!/usr/bin/env bash
# The dream stage on a CUDA GPU, without Python in the programs: build the
# top-level CMake project with -DDREAMSTAGE_BUILD_CHECKS=ON, then
#   1. dream_gpu_check on the tiny models (F32 and Q8_0): CPU vs CUDA losses,
#      gradient rel L2, decode after training (exit 1 on a disagreement);
#   2. dream_gpu_bench on a random Llama-3.2-1B-shape Q8_0 model generated here
#      (bench/gpu/make_model.py): prefill 512 tok/s and dream micro-step tok/s.
# Prepared on the dev machine (the tree travels, models do not, except the tiny ones):
#   python3 bench/gpu/trim_tree.py                    # .gpu/llama.cpp (~18 MiB)
#   python3 bench/gpu/make_model.py --dump-tokenizer .gpu/tokenizer_kv.json
#   tiny models: tests/tiny_model.write_tiny_model(Path('.gpu'), quant='f32'|'q8_0')
#   cp -r <venv>/site-packages/gguf .gpu/site/        # pure Python, for make_model.py
# then, on the device machine, from the repository root with .gpu carried:
#   bash bench/gpu/run.sh OUTDIR [chunks] [reps]
set -uo pipefail
OUT=${1:-/tmp/dream_gpu}; CHUNKS=${2:-128,512,2048}; REPS=${3:-7}
mkdir -p "$OUT"
export DREAMSTAGE_LLAMA_TREE=$PWD/.gpu/llama.cpp PYTHONPATH=$PWD/.gpu/site
B=build/cuda
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# the bench model is written by the CPU while the CUDA build runs
MODEL=/tmp/dream_bench_q8_0.gguf
( [ -s $MODEL ] || python3 bench/gpu/make_model.py --tokenizer .gpu/tokenizer_kv.json --out $MODEL --quant q8_0 ) \
    > "$OUT/make_model.log" 2>&1 &
GEN=$!
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DDREAMSTAGE_BUILD_CHECKS=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build $B -j16 > "$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
rc=0
# dream_init refuses GPU training until this check passes; these programs exist to debug it
export DREAMSTAGE_ALLOW_GPU_TRAINING=1
for m in .gpu/tiny-llama-f32-s1234.gguf .gpu/tiny-llama-q8_0-s1234.gguf; do
    $B/bin/dream_gpu_check $m > "$OUT/check_$(basename $m .gguf).txt" 2> "$OUT/check_$(basename $m .gguf).err" || rc=1
    grep -v '^{' "$OUT/check_$(basename $m .gguf).txt"
done
wait $GEN || { cat "$OUT/make_model.log"; exit 1; }
cat "$OUT/make_model.log"
$B/bin/dream_gpu_bench $MODEL 99 "$CHUNKS" "$REPS" > "$OUT/bench.json" 2> "$OUT/bench.err" || rc=1
grep -E "^chunk|FAILED|fallback|CPU" "$OUT/bench.err" | tail -40
cat "$OUT/bench.json"
exit $rc
