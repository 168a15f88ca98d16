#!/usr/bin/env bash
# The dream stage on a CUDA GPU in one command: build the top-level CMake project
# with -DDREAMSTAGE_BUILD_CHECKS=ON, then
#   0. (check) dream_op_check: one quantized product per weight type, CPU and CUDA
#      against the exact product (bench/results/dream_op_check_h200.json);
#      dream_fa_check: the fused attention backward (cuda/flash-attn-back.cu) alone
#      against double precision, and its kernels timed at 512 and 2048 tokens;
#      dream_ce_check: the cross-entropy kernels (cuda/cross-entropy.cu, patch 0107) likewise;
#   1. dream_gpu_check (CPU vs CUDA: losses, gradient rel L2, scheduler splits,
#      serving's compute buffer) on the tiny F32 and Q8_0 models and a small
#      Q4_K_M model, in TF32 (ggml-cuda's default) and FP32 (NVIDIA_TF32_OVERRIDE=0);
#   2. dream_gpu_bench on random Llama-3.2-1B-shape models (Q8_0, Q4_K_M, Q4_0,
#      quantized here from one generated F16 model): prefill 512 beside dream
#      micro-steps for each rank x target set x chunk, attention fused and explicit
#      (bench/gpu/dream_fa_check.cu checks and times the fused backward alone);
#   3. bench/gpu/peft_bench.py (PyTorch + PEFT) on the same shapes, same run;
#   5. (profile) DREAMSTAGE_PROFILE=1 dream_gpu_bench on the Q8_0 model (PROFILE_BASES="q8_0 q4_0" for more; PROFILE_LEVEL=2: by shape), rank 8 on
#      attn_q,attn_v at 2048 tokens: where a step's time goes, op by op (profile.txt);
#   6. (serve) bench/gpu/serve_train.py: POST /train against dreamstage serve -ngl 99
#      on the first base (needs .whl, carried: the server's dependencies as cp312
#      wheels, from `bash bench/gpu/fetch_wheels.sh` on the dev machine);
#   8. (soft) bench/gpu/soft_check.py: tests/test_soft_targets.py's checks on the GPU (the
#      regularizer's default rehearsal: soft-target loss and gradient against the NumPy
#      reference), FP32 math, the tiny model carried in .gpu; needs pytest importable;
#  12. (rpc) bench/bench_rpc.py --ngl 99 on the 1B shape: alone on the GPU against split with loopback workers
#      on the same GPU (two, then one);
#  11. (multi, 2+ GPUs) issue 51's table: dream_gpu_bench on one GPU and on two (1B and 8B shapes, Q8_0 and
#      Q4_K_M), peft_bench.py --shape 8b on one GPU and two, serve_train.py with --split-mode layer;
#  10. (split) dream_split_check: the tiny F32 model split over two GPUs (one GPU: the CPU and the GPU)
#      against one GPU: loss, gradient, the per-device optimizer, the gate per device;
#   9. (walk) bench/bench_groups.py (P = 512 and 2048, D = 16, G = 8) and bench/bench_exact_walk.py (window
#      2048, chunks of 512: plain, exact, exact + recompute) through the Python trainer on the first base;
#   7. (ab) AB_VARIANTS: the same quick bench under each set of environment variables, alternating;
#   4. (decode) dream_lora_check: the fused LoRA decode kernel (patch 0104) against exact
#      arithmetic and against upstream's nodes; dream_decode_bench: decode with a served
#      adapter against the bare model, with the fusion and without (DECODE_RANKS and
#      DECODE_TARGETS narrow it).
# Prepared on the dev machine by `bash bench/gpu/prepare.sh` (the tree travels, models do not,
# except the tiny ones); then, on the device machine, from the repository root with .gpu and .whl carried:
#   bash bench/gpu/run.sh OUTDIR [phases=check,bench,peft(,decode)] [chunks=512,2048] [reps=5] [ranks=8,16] [targets="attn_q,attn_v;all"] [bases=q8_0,q4_k_m,q4_0]
# Writes OUTDIR/check_*.txt, OUTDIR/bench_<base>.json, OUTDIR/peft.json. Exit 1 when a check fails.
set -uo pipefail
OUT=${1:-/tmp/dream_gpu}; PHASES=${2:-check,bench,peft}; CHUNKS=${3:-512,2048}; REPS=${4:-5}
RANKS=${5:-8,16}; TARGETS=${6:-"attn_q,attn_v;all"}; BASES=${7:-q8_0,q4_k_m,q4_0}
mkdir -p "$OUT"
export DREAMSTAGE_LLAMA_TREE=$PWD/.gpu/llama.cpp PYTHONPATH=$PWD/.gpu/site
B=${DREAMSTAGE_GPU_BUILD:-/tmp/dream_cuda_build}
M=/tmp/dream_models; mkdir -p $M
has() { [[ ",$PHASES," == *",$1,"* ]]; }
# the 1B-shape model in base $1, quantized from the F16 one unless an earlier phase made it
quantized() { [ -s $M/llama1b_$1.gguf ] || $B/bin/dream_quantize $M/llama1b_f16.gguf $M/llama1b_$1.gguf $1 > "$OUT/quantize_$1.log" 2>&1; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$OUT/device.txt"
# PyTorch + PEFT first, on a quiet machine: at these sizes its steps are bound
# by the host's kernel launches, so running it beside the CUDA build (16
# compiler processes) measured it 20-55% slow (14,842 tok/s at 2048 q,v
# against 19,249-33,356 alone)
if has peft; then
    python3 bench/gpu/peft_bench.py --seqs "$CHUNKS" --ranks "$RANKS" --targets qv,all > "$OUT/peft_runs.json" 2> "$OUT/peft.err"
    tail -1 "$OUT/peft_runs.json" > "$OUT/peft.json"
    # the stronger anchor: PEFT with liger-kernel's Llama kernels (the wheel carried in .whl/liger)
    if ls .whl/liger/*.whl > /dev/null 2>&1; then
        L=/tmp/dream_liger_site; rm -rf $L
        python3 -m pip install -q --no-index --no-deps --target $L .whl/liger/*.whl > "$OUT/liger_site.log" 2>&1 &&
        PYTHONPATH=$L:$PYTHONPATH python3 bench/gpu/peft_bench.py --liger --seqs "$CHUNKS" --ranks "$RANKS" --targets qv,all \
            > "$OUT/peft_liger_runs.json" 2> "$OUT/peft_liger.err"
        tail -1 "$OUT/peft_liger_runs.json" > "$OUT/peft_liger.json"
    fi
fi
# models are written by the CPU while the CUDA build runs
( python3 bench/gpu/make_model.py --tokenizer .gpu/tokenizer_kv.json --out $M/small_f32.gguf --quant f32 --shape small
  if has bench || has walk || has decode || has profile || has serve || has ab || has multi || has rpc; then [ -s $M/llama1b_f16.gguf ] || python3 bench/gpu/make_model.py --tokenizer .gpu/tokenizer_kv.json --out $M/llama1b_f16.gguf --quant f16; fi
) > "$OUT/make_model.log" 2>&1 &
GEN=$!
t0=$(date +%s)
cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
      -DDREAMSTAGE_BUILD_CHECKS=ON > "$OUT/configure.log" 2>&1 || { tail -30 "$OUT/configure.log"; exit 1; }
cmake --build $B -j16 > "$OUT/build.log" 2>&1 || { grep -E "error|Error" "$OUT/build.log" | head -30; exit 1; }
echo "build: $(( $(date +%s) - t0 )) s"
wait $GEN || { cat "$OUT/make_model.log"; exit 1; }
cat "$OUT/make_model.log"
rc=0
# CHECK_STAGE_ONLY=1: the check phase runs dream_gpu_check alone (no kernel-level checks or their nvcc builds)
if has check && [ -z "${CHECK_STAGE_ONLY:-}" ]; then
    $B/bin/dream_op_check 2048 2048 > "$OUT/op_check.txt" 2>&1 || rc=1
    { nvcc -O3 -arch=sm_90 -std=c++17 -o $B/dream_fa_check bench/gpu/dream_fa_check.cu && $B/dream_fa_check; } > "$OUT/fa_check.txt" 2>&1 || rc=1
    echo "== fa_check"; cat "$OUT/fa_check.txt"
    { nvcc -O3 -arch=sm_90 -std=c++17 -o $B/dream_ce_check bench/gpu/dream_ce_check.cu && $B/dream_ce_check; } > "$OUT/ce_check.txt" 2>&1 || rc=1
    echo "== ce_check"; cat "$OUT/ce_check.txt"
    # a failed kernel check leaves its op to ggml-cuda for the rest of the run, so the
    # benchmark still measures correct steps (the failure is in rc)
    grep -q "ALL PASS" "$OUT/ce_check.txt" || export DREAMSTAGE_CE_KERNEL=0
fi
if has check; then
    Q=$B/bin/dream_quantize
    { $Q $M/small_f32.gguf $M/small_q4_k_m.gguf q4_k_m && $Q $M/small_q4_k_m.gguf $M/small_q4_k_m_twin.gguf f32 &&
      { [ ! -s .gpu/tiny-llama-q8_0-s1234.gguf ] || $Q .gpu/tiny-llama-q8_0-s1234.gguf $M/tiny_q8_0_twin.gguf f32; }; } > "$OUT/quantize_small.log" 2>&1 || { tail "$OUT/quantize_small.log"; exit 1; }
    for math in tf32 fp32; do
        # a quantized model is checked against its dequantized F32 twin too (dream_gpu_check.cpp says why)
        for m in ".gpu/tiny-llama-f32-s1234.gguf f32" ".gpu/tiny-llama-q8_0-s1234.gguf q8_0 $M/tiny_q8_0_twin.gguf" \
                 "$M/small_q4_k_m.gguf q4_k_m $M/small_q4_k_m_twin.gguf"; do
            set -- $m; kind=$2; name=check_${kind}_$math
            [ -s "$1" ] || { echo "== $name: $1 not carried, skipped"; continue; }
            ( [ $math = fp32 ] && export NVIDIA_TF32_OVERRIDE=0; $B/bin/dream_gpu_check "$@" ) > "$OUT/$name.txt" 2> "$OUT/$name.err" || rc=1
            echo "== $name"; grep -v "^  gpu_layers" "$OUT/$name.txt"
        done
    done
fi
if has split; then
    # the model split over two GPUs (or the CPU and the one GPU) against one GPU (dream_split_check.cpp)
    for math in tf32 fp32; do
        name=split_f32_$math
        ( [ $math = fp32 ] && export NVIDIA_TF32_OVERRIDE=0; $B/bin/dream_split_check .gpu/tiny-llama-f32-s1234.gguf ) \
            > "$OUT/$name.txt" 2> "$OUT/$name.err" || rc=1
        echo "== $name"; tail -n 3 "$OUT/$name.txt"
    done
fi
if has bench; then
    for base in ${BASES//,/ }; do
        $B/bin/dream_quantize $M/llama1b_f16.gguf $M/llama1b_$base.gguf $base > "$OUT/quantize_$base.log" 2>&1 || { tail "$OUT/quantize_$base.log"; exit 1; }
        $B/bin/dream_gpu_bench $M/llama1b_$base.gguf 99 "$CHUNKS" "$REPS" "$RANKS" "$TARGETS" > "$OUT/bench_$base.json" 2> "$OUT/bench_$base.err" || rc=1
        echo "== bench $base"; grep -E "FAILED" "$OUT/bench_$base.err" | tail -5
        python3 - "$OUT/bench_$base.json" <<'PY'
import json, sys
try:
    d = json.load(open(sys.argv[1]))
except Exception as e:
    print("no JSON:", e); sys.exit(0)
for r in d["runs"]:
    print(f'  r{r["rank"]} {("all" if r["targets"].count(",") == 6 else r["targets"]):14s} chunk {r["chunk"]:5d}: train {r["train_tok_s"]["median"]:9.0f} tok/s '
          f'(graph built every step: {r.get("train_tok_s_without_graph_reuse", {}).get("median", 0):9.0f}), '
          f'prefill512 {r["prefill512_tok_s"]["median"]:8.0f}, splits {r["n_splits"]}, graph {r["graph_mib"]:.0f} MiB; '
          f'fused attention {r.get("fused_attention")}, explicit: {(r.get("train_tok_s_explicit_attention") or {}).get("median", 0):9.0f} tok/s, '
          f'graph {r.get("graph_mib_explicit_attention", 0):.0f} MiB')
print(f'  decode before {d["decode_tok_s_before_training"]:.0f}, with adapter {d["decode_tok_s_after_training_with_adapter"]:.0f} tok/s; serving bytes {d["serving_compute_bytes_before"]} -> {d["serving_compute_bytes_after"]}')
PY
    done
    nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader > "$OUT/nvidia_smi_after.txt"
fi
# decode with a served adapter: the fused LoRA decode kernel (patch 0104) op by op
# against exact arithmetic and against upstream's nodes (dream_lora_check), then
# whole decodes against the bare model, with the fusion and without it, in
# alternating processes (without, with, without, with) on each base
if has decode; then
    $B/bin/dream_lora_check > "$OUT/lora_check.json" 2> "$OUT/lora_check.err" || rc=1
    echo "== lora_check"; grep -E '"pass"|us_per_token|FAILED' "$OUT/lora_check.json"
    for base in ${BASES//,/ }; do
        quantized $base
        for k in 1 2; do for f in 0 1; do
            DREAMSTAGE_LORA_FUSION=$f $B/bin/dream_decode_bench $M/llama1b_$base.gguf 99 "${DECODE_RANKS:-$RANKS}" "${DECODE_TARGETS:-$TARGETS}" 5 128 \
                > "$OUT/decode_${base}_f${f}_$k.json" 2> "$OUT/decode_${base}_f${f}_$k.err" || rc=1
        done; done
        python3 - "$OUT" "$base" <<'PY'
import json, sys
out, base = sys.argv[1], sys.argv[2]
try:
    runs = {f: [json.load(open(f"{out}/decode_{base}_f{f}_{k}.json")) for k in (1, 2)] for f in (0, 1)}
except Exception as e:
    print("no JSON:", e); sys.exit(0)
for i, r in enumerate(runs[0][0]["runs"]):
    cols = [f'fusion {f}: {d["runs"][i]["decode_tok_s_without"]:.0f} -> {d["runs"][i]["decode_tok_s_with"]:.0f} '
            f'({100 * d["runs"][i]["cost"]:.1f}%)' for f in (0, 1) for d in runs[f]]
    print(f'  decode {base} r{r["rank"]} {"all" if r["targets"].count(",") == 6 else r["targets"]}: ' + "; ".join(cols))
PY
    done
fi
# PROFILE_BASES (default q8_0) names the bases profiled; each writes profile_<base>.txt
if has profile; then
    for base in ${PROFILE_BASES:-q8_0}; do
        quantized $base
        DREAMSTAGE_PROFILE=${PROFILE_LEVEL:-1} $B/bin/dream_gpu_bench $M/llama1b_$base.gguf 99 2048 3 8 attn_q,attn_v > "$OUT/profile_$base.json" 2> "$OUT/profile_$base.txt" || rc=1
        echo "== profile $base (last step)"; tac "$OUT/profile_$base.txt" | grep -m1 -B40 "dream profile: .* nodes, " | tac | head -44
    done
fi
# (ab) same-run A/B: dream_gpu_bench (DREAM_BENCH_QUICK=1: fused attention, graph reuse)
# on the first base for each variant of AB_VARIANTS (';'-separated environment
# assignments, space-separated within one; an empty variant is the default), in
# alternating processes, twice: ab_<variant index>_<round>.json
if has ab; then
    base=${BASES%%,*}; quantized $base
    IFS=';' read -r -a variants <<< "${AB_VARIANTS:-}"
    [ ${#variants[@]} -eq 0 ] && variants=("")
    for k in 1 2; do for i in "${!variants[@]}"; do
        env DREAM_BENCH_QUICK=1 ${variants[$i]} $B/bin/dream_gpu_bench $M/llama1b_$base.gguf 99 "$CHUNKS" "$REPS" "$RANKS" "$TARGETS" \
            > "$OUT/ab_${i}_$k.json" 2> "$OUT/ab_${i}_$k.err" || rc=1
    done; done
    echo "== ab $base"
    python3 - "$OUT" "${AB_VARIANTS:-}" <<'PY'
import json, sys
out, variants = sys.argv[1], (sys.argv[2].split(";") if sys.argv[2] else [""])
for i, v in enumerate(variants):
    for k in (1, 2):
        try:
            d = json.load(open(f"{out}/ab_{i}_{k}.json"))
        except Exception as e:
            print(f"  [{v or 'default'}] round {k}: no JSON ({e})"); continue
        print(f"  [{v or 'default'}] round {k}: " + "; ".join(
            f'r{r["rank"]} {r["targets"] if r["targets"].count(",") < 6 else "all"} {r["chunk"]}: '
            f'{r["train_tok_s"]["median"]:.0f} tok/s ({r["step_ms"]["median"]:.2f} ms)' for r in d["runs"]))
PY
fi
# POST /train against `dreamstage serve -ngl 99` (bench/gpu/serve_train.py) on the
# first base: the server's Python dependencies travel as wheels in .whl (cp312),
# the bindings in .gpu/site/llama_cpp; the package is assembled in a site folder
# with server/ as dreamstage.server, as the editable install maps it
# the package, its server and their dependencies (.whl) in a site folder $1 (the checkout's
# ./dreamstage has no dreamstage.server uninstalled); the log in $OUT/$2
make_site() {
    rm -rf "$1"; mkdir -p "$1"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$1" .whl/*.whl > "$OUT/$2" 2>&1 &&
    cp -r dreamstage "$1"/ && cp -r server "$1"/dreamstage/server && cp vendor/pin.json "$1"/dreamstage/ &&
    cp -r .gpu/site/llama_cpp .gpu/site/gguf "$1"/
}
if has rpc; then
    # issue 50 on the GPU: the model alone on the GPU against it split with loopback workers on the same GPU
    # (bench/bench_rpc.py --ngl), two workers and one, at chunks of RPC_CHUNKS; the worker program beside the
    # libraries, where rpc-worker looks (the build tree's program has no rpath to them: LD_LIBRARY_PATH)
    S=/tmp/dream_rpc_site
    base=${BASES%%,*}
    quantized $base
    cp $B/dreamstage-rpc-server $B/bin/
    if make_site $S rpc_site.log; then
        for c in ${RPC_CHUNKS:-64 512}; do
            for w in "" --single-worker; do
                name=rpc_gpu_c$c${w:+_single}
                PYTHONPATH=$S LLAMA_CPP_LIB_PATH=$B/bin LD_LIBRARY_PATH=$B/bin timeout ${RPC_TIMEOUT_S:-300} \
                    python3 -P bench/bench_rpc.py --model $M/llama1b_$base.gguf --ngl 99 --threads 8 --chunk $c \
                    --decode 64 --reps ${RPC_REPS:-5} $w --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1 || rc=1
                echo "== $name"; tail -n 6 "$OUT/$name.log"
            done
        done
    else
        rc=1; tail -5 "$OUT/rpc_site.log"
    fi
fi
if has multi; then
    # issue 51: one GPU against two (llama.cpp's default layer split over the visible GPUs), the 1B and
    # 8B shapes in Q8_0 and Q4_K_M; PyTorch + PEFT on the 8B shape on one GPU and its blocks over two;
    # then POST /train through `dreamstage serve --split-mode layer --tensor-split 1,1` on the 8B Q4_K_M
    [ -s $M/llama8b_f16.gguf ] || python3 bench/gpu/make_model.py --tokenizer .gpu/tokenizer_kv.json --out $M/llama8b_f16.gguf \
        --quant f16 --shape llama-8b > "$OUT/make_model_8b.log" 2>&1 || { tail "$OUT/make_model_8b.log"; exit 1; }
    for shape in llama1b llama8b; do
        for base in q8_0 q4_k_m; do
            [ -s $M/${shape}_$base.gguf ] || $B/bin/dream_quantize $M/${shape}_f16.gguf $M/${shape}_$base.gguf $base > "$OUT/quantize_${shape}_$base.log" 2>&1
            for gpus in 1 2; do
                name=multi_${shape}_${base}_${gpus}gpu
                CUDA_VISIBLE_DEVICES=$( [ $gpus = 1 ] && echo 0 || echo 0,1 ) $B/bin/dream_gpu_bench $M/${shape}_$base.gguf 99 \
                    "$CHUNKS" "$REPS" "$RANKS" "$TARGETS" > "$OUT/$name.json" 2> "$OUT/$name.err" || rc=1
                echo "== $name"; python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
for r in d['runs']:
    print(f'  r{r[\"rank\"]} {r[\"targets\"][:14]:14s} {r[\"chunk\"]:5d}: train {r[\"train_tok_s\"][\"median\"]:8.0f} tok/s, splits {r[\"n_splits\"]}')
print(f'  decode {d[\"decode_tok_s_before_training\"]:.0f} tok/s')" "$OUT/$name.json" || tail -5 "$OUT/$name.err"
            done
        done
    done
    for gpus in 1 2; do
        python3 bench/gpu/peft_bench.py --shape 8b --gpus $gpus --seqs "$CHUNKS" --ranks "$RANKS" --targets qv,all \
            > "$OUT/multi_peft_8b_${gpus}gpu_runs.json" 2> "$OUT/multi_peft_8b_${gpus}gpu.err" || rc=1
        tail -n 1 "$OUT/multi_peft_8b_${gpus}gpu_runs.json"
    done
    if make_site /tmp/dream_multi_site multi_site.log; then
        PYTHONPATH=/tmp/dream_multi_site LLAMA_CPP_LIB_PATH=$B/bin python3 bench/gpu/serve_train.py $M/llama8b_q4_k_m.gguf \
            --serve-args "--split-mode layer --tensor-split 1,1" > "$OUT/multi_serve_train.json" 2> "$OUT/multi_serve_train.err" || rc=1
        echo "== multi serve_train"; head -c 600 "$OUT/multi_serve_train.json"; echo
    else
        rc=1
    fi
fi
if has serve; then
    S=/tmp/dream_serve_site
    base=${BASES%%,*}
    quantized $base
    if make_site $S serve_site.log; then
        PYTHONPATH=$S LLAMA_CPP_LIB_PATH=$B/bin python3 bench/gpu/serve_train.py $M/llama1b_$base.gguf ${SERVE_ARGS:-} \
            > "$OUT/serve_train.json" 2> "$OUT/serve_train.err" || rc=1
        echo "== serve_train $base"; python3 -c "
import json, sys
d = json.load(open(sys.argv[1]))
j = d.get('job', {})
print(' ', j.get('state'), j.get('message'), '| before', repr(d.get('before', {}).get('text')), 'after', repr(d.get('after', {}).get('text')),
      '| GPU MiB serving/peak/after', d.get('gpu_mib_serving'), d.get('gpu_mib_peak_during'), d.get('gpu_mib_after'), '|', d.get('error', ''))
" "$OUT/serve_train.json" || tail -20 "$OUT/serve_train.err"
    else
        rc=1; tail -5 "$OUT/serve_site.log"
    fi
fi
if has soft; then
    S=/tmp/dream_soft_site
    make_site $S soft_site.log || { rc=1; tail -5 "$OUT/soft_site.log"; }
    # every layer offloaded (ResidentConfig's n_gpu_layers -1); the native log says where they went;
    # -P: the package from the site folder, not the checkout's ./dreamstage (no server there)
    NVIDIA_TF32_OVERRIDE=0 DREAMSTAGE_NATIVE_LOG=1 PYTHONPATH=$S:$PWD/tests LLAMA_CPP_LIB_PATH=$B/bin \
        python3 -P bench/gpu/soft_check.py .gpu/tiny-llama-f32-s1234.gguf > "$OUT/soft_check.txt" 2>&1 || rc=1
    echo "== soft_check"; grep -E "offloaded|using device|\[oracle\]|PASS|FAIL|Error" "$OUT/soft_check.txt" | head -30
fi
if has walk; then
    # prefix groups and the exact walk through the Python trainer, every layer on the GPU, the first base
    S=/tmp/dream_walk_site
    base=${BASES%%,*}
    quantized $base
    if make_site $S walk_site.log; then
        export PYTHONPATH=$S LLAMA_CPP_LIB_PATH=$B/bin
        python3 -P bench/bench_groups.py --model $M/llama1b_$base.gguf --prompts 512,2048 --replies 16 --groups 8 \
            --extra "" --one-chunk "" --chunk 512 --threads 4 --warmup --separate-windows 0 --out "$OUT/groups_$base.json" \
            > "$OUT/groups.log" 2>&1 || rc=1
        python3 -P bench/bench_exact_walk.py --model $M/llama1b_$base.gguf --windows 2048 --chunks 512 \
            --walks plain,exact,exact+recompute --reps 4 --threads 4 --out "$OUT/exact_walk_$base.json" > "$OUT/exact_walk.log" 2>&1 || rc=1
        export PYTHONPATH=$PWD/.gpu/site; unset LLAMA_CPP_LIB_PATH
        echo "== walk $base"; tail -n 4 "$OUT/groups.log" "$OUT/exact_walk.log"
    else
        rc=1; tail -5 "$OUT/walk_site.log"
    fi
fi
if has peft; then
    cat "$OUT/peft.json"; cat "$OUT/peft_liger.json" 2>/dev/null || tail -5 "$OUT/peft_liger.err"
fi
exit $rc
