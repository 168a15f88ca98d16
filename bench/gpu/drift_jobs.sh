#!/usr/bin/env bash
# The drift guard's real jobs (bench/bench_drift_job.py, bench/bench_readme_job.py)
# on the GPU machine with the default model, every layer offloaded: what issue 12's
# defaults do on a GPU, where the CPU figures in docs/benchmarks.md come from.
#
# The default model (SmolLM2-135M-Instruct Q4_1, 98 MB) is more than one call may
# carry (64 MiB with the tree), so it travels in parts, one call each, back to
# back: the machine keeps /tmp while it stays warm. On the dev machine:
#   python3 bench/gpu/trim_tree.py; mkdir -p .gpu/parts
#   split -b 33M -d ~/.cache/dreamstage/models/SmolLM2-135M-Instruct.Q4_1.gguf .gpu/parts/model.   # 3 parts
# then, each call carrying .gpu/part (one part copied there before the call):
#   bash bench/gpu/drift_jobs.sh build     # + .gpu/llama.cpp .gpu/site .whl: the CUDA
#                                          #   build and the server's site folder
#   bash bench/gpu/drift_jobs.sh part      # appends .gpu/part/* to the model
#   bash bench/gpu/drift_jobs.sh drift ARGS...   # checks the model against its pinned
#   bash bench/gpu/drift_jobs.sh readme ARGS...  #   sha256, runs the bench with ARGS
# Each phase appends its carried part first (none carried: nothing appended).
# A bench's JSON goes where its --out says ($OUT on the device returns it).
set -uo pipefail
PHASE=${1:?phase: build, part, drift or readme}; shift
B=${DREAMSTAGE_GPU_BUILD:-/tmp/dream_cuda_build}
S=/tmp/dream_serve_site
CACHE=/tmp/dream_cache
MODEL=$CACHE/models/SmolLM2-135M-Instruct.Q4_1.gguf
mkdir -p "$CACHE/models"

if [ -d .gpu/part ]; then
    for f in .gpu/part/*; do
        cat "$f" >> "$MODEL.part" && echo "appended $f ($(stat -c %s "$f") bytes); $(stat -c %s "$MODEL.part") so far"
    done
fi

case $PHASE in
build)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    t0=$(date +%s)
    DREAMSTAGE_LLAMA_TREE=$PWD/.gpu/llama.cpp cmake -S . -B $B -G Ninja -DCMAKE_BUILD_TYPE=Release \
        -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 > /tmp/dream_configure.log 2>&1 ||
        { tail -30 /tmp/dream_configure.log; exit 1; }
    cmake --build $B -j16 > /tmp/dream_build.log 2>&1 || { grep -E "error|Error" /tmp/dream_build.log | head -30; exit 1; }
    echo "build: $(( $(date +%s) - t0 )) s"
    # the package with server/ as dreamstage.server (as the editable install maps it),
    # its dependencies from .whl and the bindings from .gpu/site
    rm -rf $S; mkdir -p $S
    python3 -m pip install -q --no-index --no-deps --no-compile --target $S .whl/*.whl &&
        cp -r dreamstage $S/ && cp -r server $S/dreamstage/server && cp vendor/pin.json $S/dreamstage/ &&
        cp -r .gpu/site/llama_cpp .gpu/site/gguf $S/ || exit 1
    echo "site: $S"
    ;;
part) ;;
drift|readme)
    if [ -f "$MODEL.part" ]; then
        want=$(PYTHONPATH=$S python3 -c "from dreamstage.default_model import DEFAULT_MODEL_WHEEL as w; print(w['member_sha256'])")
        got=$(sha256sum "$MODEL.part" | cut -d' ' -f1)
        [ "$got" = "$want" ] || { echo "the assembled model's sha256 is $got, not $want"; exit 1; }
        mv "$MODEL.part" "$MODEL"
    fi
    [ -f "$MODEL" ] || { echo "no model at $MODEL: carry its parts first"; exit 1; }
    # the checkout's sources, not the site's copy from the build call, so a later
    # call's change to the package is what runs
    rm -rf $S/dreamstage && cp -r dreamstage $S/ && cp -r server $S/dreamstage/server && cp vendor/pin.json $S/dreamstage/
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
    bench=bench/bench_drift_job.py; [ "$PHASE" = readme ] && bench=bench/bench_readme_job.py
    DREAMSTAGE_CACHE=$CACHE PYTHONPATH=$S LLAMA_CPP_LIB_PATH=$B/bin python3 $bench "$@"
    ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
