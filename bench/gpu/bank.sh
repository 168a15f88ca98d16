#!/usr/bin/env bash
# The adapter bank (dream-bank.cpp) on a CUDA GPU in one command: build dream_bank_bench
# and dream_quantize only, then
#   1. dream_bank_bench check on the small F32 model: one batch with seqs on two LoRAs
#      and on the base, each against that LoRA alone (llama_set_adapters_lora), on the
#      CPU and on CUDA, and CUDA's mixed batch against the CPU's; in TF32 (ggml-cuda's
#      default) and in FP32 (NVIDIA_TF32_OVERRIDE=0);
#   2. dream_bank_bench bench on the random Llama-3.2-1B-shape model in each base
#      (quantized here from one generated F16 model): decode tok/s of 4 and 8 streams,
#      base / one adapter on the context / the bank on one slot / the bank mixed.
# Prepared on the dev machine as bench/gpu/run.sh says (.gpu/llama.cpp from trim_tree.py,
# .gpu/tokenizer_kv.json, .gpu/site/gguf), then on the device machine from the root:
#   bash bench/gpu/bank.sh OUTDIR [bases=q8_0,q4_k_m] [ranks=8] [targets="attn_q,attn_v;all"]
# GATHERS="bgmv dense id" (default: dense) runs each under DREAMSTAGE_BANK_GATHER=<gather>;
# BANK_RANK=R pads the bank's slots to rank R (default: the adapters' rank).
# Writes OUTDIR/bank_check_<gather>_{tf32,fp32}.json and OUTDIR/bank_bench_<gather>_<base>.json.
# Exit 1 when a check fails.
set -uo pipefail
OUT=${1:-/tmp/dream_bank}; BASES=${2:-q8_0,q4_k_m}; RANKS=${3:-8}; TARGETS=${4:-"attn_q,attn_v;all"}
mkdir -p "$OUT"
export DREAMSTAGE_LLAMA_TREE=$PWD/.gpu/llama.cpp PYTHONPATH=$PWD/.gpu/site
B=${DREAMSTAGE_GPU_BUILD:-/tmp/dream_cuda_build}
M=/tmp/dream_models; mkdir -p $M
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
( python3 bench/gpu/make_model.py --tokenizer .gpu/tokenizer_kv.json --out $M/small_f32.gguf --quant f32 --shape small
  [ -s $M/llama1b_f16.gguf ] || python3 bench/gpu/make_model.py --tokenizer .gpu/tokenizer_kv.json --out $M/llama1b_f16.gguf --quant f16
) > "$OUT/make_model.log" 2>&1 &
GEN=$!
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DDREAMSTAGE_BUILD_CHECKS=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build $B -j16 --target dream_bank_bench dream_quantize > "$OUT/build.log" 2>&1 \
    || { grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
wait $GEN || { cat "$OUT/make_model.log"; exit 1; }
rc=0
for g in ${GATHERS:-dense}; do
    export DREAMSTAGE_BANK_GATHER=$g
    for math in tf32 fp32; do
        ( [ $math = fp32 ] && export NVIDIA_TF32_OVERRIDE=0; $B/bin/dream_bank_bench check $M/small_f32.gguf $M ) \
            > "$OUT/bank_check_${g}_$math.json" 2> "$OUT/bank_check_${g}_$math.err" || rc=1
        echo "== check $g $math"; cat "$OUT/bank_check_${g}_$math.json"
    done
done
for base in ${BASES//,/ }; do
    [ -s $M/llama1b_$base.gguf ] || $B/bin/dream_quantize $M/llama1b_f16.gguf $M/llama1b_$base.gguf $base > "$OUT/quantize_$base.log" 2>&1
    for g in ${GATHERS:-dense}; do
        DREAMSTAGE_BANK_GATHER=$g $B/bin/dream_bank_bench bench $M/llama1b_$base.gguf $M "$RANKS" "$TARGETS" 4,8 3 64 ${BANK_RANK:-0} \
            > "$OUT/bank_bench_${g}_${base}_r${BANK_RANK:-0}.json" 2> "$OUT/bank_bench_${g}_$base.err" || rc=1
        echo "== bench $g $base"; grep -h '"rank"' "$OUT/bank_bench_${g}_$base.err" || tail -5 "$OUT/bank_bench_${g}_$base.err"
    done
done
exit $rc
