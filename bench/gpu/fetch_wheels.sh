#!/usr/bin/env bash
# The server's Python dependencies that the GPU machine's image lacks, as CPython
# 3.12 manylinux wheels in .whl/ (ignored by git: .git/info/exclude), for
# `bench/gpu/run.sh ... serve`, which installs them into a site folder there.
# The versions are the ones the dev venv resolved (requirements/runtime.txt and
# what those pins pulled in), so the server on the GPU runs what the tests ran.
#   bash bench/gpu/fetch_wheels.sh [VENV=.venv]
# The image already has numpy, jinja2, typing-extensions, httpx, anyio, h11,
# click, idna and prometheus-client; gguf travels as source in .gpu/site.
set -euo pipefail
VENV=${1:-.venv}
WANT="fastapi starlette uvicorn sse-starlette httpx-sse pydantic pydantic-core pydantic-settings python-dotenv
annotated-types typing-inspection annotated-doc diskcache opentelemetry-api"
freeze=$("$VENV/bin/python" -m pip freeze --all 2>/dev/null | tr '[:upper:]_' '[:lower:]-')
pins=()
for name in $WANT; do
    pin=$(printf '%s\n' "$freeze" | grep -E "^$name==" || true)
    if [ -z "$pin" ]; then
        echo "fetch_wheels: $name is not installed in $VENV (./dev.sh setup first)" >&2
        exit 1
    fi
    pins+=("$pin")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${pins[@]}"
ls .whl
