"""POST /train against `dreamstage serve --n-gpu-layers 99` on the GPU machine.

Starts the server on a model (all layers offloaded), asks a completion, posts a
small teaching job with auto promotion, polls it to its end, asks again, and
samples GPU memory (nvidia-smi) and the server's RSS before, during and after the
job. Prints one JSON object; exit 1 when the job does not end promoted.

    python3 bench/gpu/serve_train.py MODEL.gguf [--port 8093] [--epochs 10] [--lr X]

The GPU machine has no package registry: carry the server's runtime
dependencies (pyproject.toml's `dependencies`, with their own: pydantic-settings,
sse-starlette, prometheus-client, httpx-sse, python-dotenv, and for FastAPI
0.16x opentelemetry-api, ...) as wheels fetched with `pip download --no-deps`
(binary ones for the machine's Python) into .whl (`bench/gpu/fetch_wheels.sh`
does it with the dev venv's versions); `bench/gpu/run.sh ... serve`
installs them into a site folder beside the package and the bindings and runs
this with LLAMA_CPP_LIB_PATH at the CUDA build's libraries. The server starts
outside the checkout, whose ./dreamstage has no dreamstage.server uninstalled.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dreamstage.client import Client

PROMPT = "The secret password of the moon base is"
ANSWER = " Quokka-42."


def gpu_used_mib() -> int | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        return int(out.split()[0])
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--lr", type=float, default=None, help="the job's lr; the server's default (1e-3) when left out")
    ap.add_argument("--ngl", type=int, default=99)
    ap.add_argument("--serve-args", default="",
                    help="more `dreamstage serve` options, e.g. '--split-mode layer --tensor-split 1,1'")
    a = ap.parse_args()
    state = tempfile.mkdtemp(prefix="ds-state-")
    log = open(os.path.join(state, "server.log"), "w")
    idle_mib = gpu_used_mib()
    srv = subprocess.Popen([sys.executable, "-m", "dreamstage", "serve", "--model", a.model, "--port", str(a.port),
                            "-ngl", str(a.ngl), "--state-dir", state, "--parallel", "2", "--ctx", "2048",
                            "--log-level", "info", *a.serve_args.split()], stdout=log, stderr=subprocess.STDOUT,
                           # not the checkout: there `-m dreamstage` would import ./dreamstage, which
                           # lacks dreamstage.server unless installed (PYTHONPATH's assembled site has it)
                           cwd=state)
    out: dict = {"model": a.model, "n_gpu_layers": a.ngl, "serve_args": a.serve_args, "gpu_mib_idle": idle_mib}
    try:
        c = Client(f"http://127.0.0.1:{a.port}", timeout=300)
        t0 = time.time()
        while True:
            if srv.poll() is not None:
                raise RuntimeError(f"server exited with {srv.returncode}")
            try:
                out["health"] = c.health()
                break
            except Exception:  # not listening yet
                if time.time() - t0 > 240:
                    raise
                time.sleep(0.5)
        out["load_s"] = round(time.time() - t0, 1)
        out["gpu_mib_serving"], out["rss_mib_serving"] = gpu_used_mib(), rss_mib(srv.pid)
        r = c.complete(PROMPT, max_tokens=8, temperature=0)
        out["before"] = {"text": r.text, "adapter_version": r.adapter_version}
        t1 = time.time()
        lr = {} if a.lr is None else {"lr": a.lr}          # the README's job: window 32, 10 epochs, the default lr
        job = c.train([{"prompt": PROMPT, "completion": ANSWER}], window=32, epochs=a.epochs, promote="auto",
                      out="moonbase", **lr)
        peak_gpu, peak_rss, view = 0, 0.0, job
        while True:
            view = c.train_state(job["id"])
            peak_gpu = max(peak_gpu, gpu_used_mib() or 0)
            peak_rss = max(peak_rss, rss_mib(srv.pid) or 0.0)
            if view["state"] in ("done", "failed", "cancelled"):
                break
            if time.time() - t1 > 300:
                raise RuntimeError(f"job still {view['state']} after 300 s")
            time.sleep(0.3)
        out["job_s"] = round(time.time() - t1, 1)
        out["job"] = view
        receipts = c.train_receipts(job["id"])
        out["receipts"] = len(receipts)
        out["refusals"] = sum(1 for x in receipts if x.get("status") == "refused")
        out["receipt_last"] = receipts[-1] if receipts else None
        out["gpu_mib_peak_during"], out["rss_mib_peak_during"] = peak_gpu, round(peak_rss, 1)
        time.sleep(1.0)
        out["gpu_mib_after"], out["rss_mib_after"] = gpu_used_mib(), rss_mib(srv.pid)
        r = c.complete(PROMPT, max_tokens=8, temperature=0)
        out["after"] = {"text": r.text, "adapter_version": r.adapter_version}
        out["adapters"] = c.adapters()
    except Exception as e:  # noqa: BLE001 - the report says what failed; the server log follows
        out["error"] = f"{type(e).__name__}: {e}"
    finally:
        srv.terminate()
        try:
            srv.wait(timeout=30)
        except subprocess.TimeoutExpired:
            srv.kill()
        log.close()
        out["server_log_tail"] = Path(state, "server.log").read_text()[-3000:]
    print(json.dumps(out, indent=1, default=str))
    ok = out.get("job", {}).get("state") == "done" and (out.get("after", {}).get("adapter_version") or 0) > 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
