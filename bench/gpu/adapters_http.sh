#!/usr/bin/env bash
# bench/bench_adapters_http.py on the GPU: dreamstage serve and llama-server (both -ngl 99,
# the pinned patched tree with CUDA) decoding streams on the base, one LoRA, or a LoRA each,
# through HTTP, on the random Llama-3.2-1B-shape model. Run on the device machine after
# bench/gpu/bank.sh on the same machine: it reuses that run's CUDA build (the libraries the
# Python package loads) and models. Prepared on the dev machine: `python3 bench/gpu/trim_tree.py
# --server` (llama-server's sources), `bash bench/gpu/fetch_wheels.sh` (.whl, carried), and
# .gpu/site/llama_cpp (the bindings: cp -r <venv>/site-packages/llama_cpp .gpu/site/, without lib/).
#   bash bench/gpu/adapters_http.sh OUTDIR [base=q8_0] [extra bench_adapters_http.py args...]
set -uo pipefail
OUT=${1:-/tmp/dream_http}; BASE=${2:-q8_0}; shift 2 2>/dev/null || shift $#
mkdir -p "$OUT"
B=${DREAMSTAGE_GPU_BUILD:-/tmp/dream_cuda_build}; M=/tmp/dream_models; S=/tmp/dream_http_site
[ -s $M/llama1b_$BASE.gguf ] && [ -e $B/bin/libllama.so ] || { echo "run bench/gpu/bank.sh first"; exit 2; }
rm -rf $S; mkdir -p $S
python3 -m pip install -q --no-index --no-deps --no-compile --target $S .whl/*.whl > "$OUT/site.log" 2>&1 || { tail -5 "$OUT/site.log"; exit 1; }
cp -r dreamstage $S/ && rm -rf $S/dreamstage/server && cp -r server $S/dreamstage/server &&
    cp vendor/pin.json $S/dreamstage/ && cp -r .gpu/site/llama_cpp .gpu/site/gguf $S/ || exit 1
export DREAMSTAGE_LLAMA_TREE=$PWD/.gpu/llama.cpp PYTHONPATH=$S LLAMA_CPP_LIB_PATH=$B/bin PYTHONUNBUFFERED=1
t0=$(date +%s)
# run from /tmp: `python -m dreamstage` then finds the site folder's package, not the checkout's
# ./dreamstage (no server there)
(cd /tmp && python3 "$OLDPWD/bench/bench_adapters_http.py" --model $M/llama1b_$BASE.gguf --ngl 99 --build-llama-server \
    --skip-prefix --out-dir "$OUT" --tag "$BASE" "$@") 2>&1 | tee "$OUT/adapters_http.log"
rc=${PIPESTATUS[0]}
echo "adapters_http: $(( $(date +%s) - t0 )) s, rc $rc"
exit $rc
