"""Serving throughput: dreamstage against upstream llama-server and llama-cpp-python's server.

The question: at 1, 4 and 8 concurrent streams (128 generated tokens each,
temperature 0, the same prompts and 2 threads for everyone), what aggregate
decode tok/s and inter-token latency does each server give on this machine?

    .venv/bin/python bench/bench_serving.py [--cycles 1] [--streams 1 4 8]

Systems:
  llama-server  upstream llama-server built from the pinned tree in vendor/llama.cpp
                (bench/.work/build-llama-server; built once, then cached);
  lcp-server    llama_cpp.server (llama-cpp-python 0.3.36) from a separate venv in
                bench/.work/lcp-venv, with LLAMA_CPP_LIB_PATH at OUR libllama;
  dreamstage    `dreamstage serve`.
Each (system, streams) run is a fresh server process. Runs are interleaved
A B C C B A per cycle so drift in machine load hits every system alike;
ratios are reported per pairing with their spread.

Writes bench/results/serving-<date>.json.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
from machine import describe

ROOT = Path(__file__).resolve().parents[1]
WORK = ROOT / "bench" / ".work"
RESULTS = ROOT / "bench" / "results"
TREE = ROOT / "vendor" / "llama.cpp"
PY = ROOT / ".venv" / "bin" / "python"

GEN_TOKENS = 128
THREADS = 2
SLOT_CTX = 512  # per slot: prompt (< 32 tokens) + 128 generated fit with room to spare

# Plain-text openings that a small model continues at length (so streams rarely stop early).
PROMPTS = [
    "Once upon a time, in a small village by the sea, there lived",
    "The history of the printing press begins",
    "Here is a detailed recipe for a classic French onion soup. First,",
    "In the year 2150, humanity had finally",
    "The most important lesson I learned in school was",
    "A guide to planting a vegetable garden: start by",
    "The old lighthouse keeper opened the door and saw",
    "Photosynthesis is the process by which plants",
]

LCP_REQS = ["llama-cpp-python==0.3.36", "fastapi==0.165.0", "uvicorn==0.54.0", "sse-starlette==3.7.0",
            "starlette-context==0.3.6", "pydantic-settings==2.16.3", "PyYAML==6.0.4", "numpy==2.4.6",
            "jinja2==3.1.6", "typing-extensions==4.16.0", "diskcache==5.6.3"]


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- systems ------------------------------------------------------------------
def ensure_llama_server() -> Path:
    build = WORK / "build-llama-server"
    exe = build / "bin" / "llama-server"
    if exe.is_file():
        return exe
    if not (TREE / "CMakeLists.txt").is_file():
        raise SystemExit("vendor/llama.cpp is not materialized; run ./dev.sh setup first")
    log("building upstream llama-server from vendor/llama.cpp (cached afterwards)")
    subprocess.run(["cmake", "-S", str(TREE), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON",
                    "-DLLAMA_BUILD_COMMON=ON", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    "-DLLAMA_CURL=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j2"], check=True,
                   stdout=subprocess.DEVNULL)
    return exe


def ensure_lcp_venv() -> Path | None:
    venv = WORK / "lcp-venv"
    py = venv / "bin" / "python"
    stamp = venv / ".bench-reqs"
    if py.is_file() and stamp.is_file() and stamp.read_text() == "\n".join(LCP_REQS):
        return py
    log("creating the llama-cpp-python server venv (no native build of its own)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    try:
        subprocess.run(pip + [r for r in LCP_REQS if not r.startswith("llama-cpp-python")], check=True)
        subprocess.run(pip + ["--no-deps", "-C", "cmake.define.LLAMA_BUILD=OFF", "-C", "cmake.define.LLAVA_BUILD=OFF",
                              LCP_REQS[0]], check=True)
    except subprocess.CalledProcessError as e:
        log(f"llama-cpp-python's server could not be installed ({e}); skipping it")
        return None
    stamp.write_text("\n".join(LCP_REQS))
    return py


def lib_dir() -> Path:
    out = subprocess.run([str(PY), "-c", "from dreamstage import native; print(native.lib_dir())"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def model_path() -> Path:
    out = subprocess.run([str(PY), "-c", "from dreamstage.default_model import default_model; print(default_model())"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(system: str, streams: int, port: int, paths: dict) -> tuple[list[str], dict]:
    ctx = SLOT_CTX * streams
    env = dict(os.environ)
    if system == "llama-server":
        return [str(paths["llama-server"]), "-m", str(paths["model"]), "--host", "127.0.0.1", "--port", str(port),
                "-np", str(streams), "-c", str(ctx), "-t", str(THREADS), "-tb", str(THREADS),
                "--no-webui", "--log-disable"], env
    if system == "lcp-server":
        env["LLAMA_CPP_LIB_PATH"] = str(paths["lib"])
        return [str(paths["lcp-python"]), "-m", "llama_cpp.server", "--model", str(paths["model"]),
                "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(ctx), "--n_threads", str(THREADS),
                "--n_threads_batch", str(THREADS),
                # By default a new request interrupts the one streaming; the bench wants them queued.
                "--interrupt_requests", "False"], env
    if system == "dreamstage":
        return [str(ROOT / ".venv" / "bin" / "dreamstage"), "serve", "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(streams), "--ctx", str(ctx), "--threads", str(THREADS)], env
    raise ValueError(system)


def wait_ready(url: str, proc: subprocess.Popen, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            r = httpx.get(url + "/v1/models", timeout=2)
            if r.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become ready")


# -- load -------------------------------------------------------------------------
async def one_stream(client: httpx.AsyncClient, prompt: str, gen_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": gen_tokens, "temperature": 0.0, "stream": True}
    t0 = time.perf_counter()
    stamps: list[float] = []
    finish = None
    async with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            obj = json.loads(data)
            ch = (obj.get("choices") or [{}])[0]
            if ch.get("text"):
                stamps.append(time.perf_counter())
            finish = ch.get("finish_reason") or finish
    return {"start": t0, "stamps": stamps, "finish": finish}


async def round_(url: str, streams: int, gen_tokens: int = GEN_TOKENS) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        t0 = time.perf_counter()
        runs = await asyncio.gather(*(one_stream(client, PROMPTS[i % len(PROMPTS)], gen_tokens)
                                      for i in range(streams)))
        t1 = time.perf_counter()
    tokens = sum(len(r["stamps"]) for r in runs)
    # Decode window: from the first token of any stream to the last token of any stream.
    firsts = [r["stamps"][0] for r in runs if r["stamps"]]
    lasts = [r["stamps"][-1] for r in runs if r["stamps"]]
    gaps = [b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    ttft = [r["stamps"][0] - r["start"] for r in runs if r["stamps"]]
    window = max(lasts) - min(firsts) if firsts else float("nan")
    return {"tokens": tokens, "short_streams": sum(1 for r in runs if len(r["stamps"]) < gen_tokens - 2),
            "wall_s": t1 - t0, "agg_tok_s": tokens / (t1 - t0),
            "decode_tok_s": (tokens - len(firsts)) / window if window > 0 else float("nan"),
            "itl": gaps, "ttft": ttft, "finish": [r["finish"] for r in runs]}


def run_system(system: str, streams: int, paths: dict) -> dict:
    port = free_port()
    argv, env = command(system, streams, port, paths)
    url = f"http://127.0.0.1:{port}"
    logf = open(WORK / f"{system}.log", "ab")
    proc = subprocess.Popen(argv, env=env, stdout=logf, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_ready(url, proc)
        asyncio.run(round_(url, 1, 16))  # warm-up: page in weights, allocate buffers
        load0 = os.getloadavg()[0]
        res = asyncio.run(round_(url, streams))
        res["loadavg_1m"] = [load0, os.getloadavg()[0]]
        return res
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        logf.close()


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q / 100 * (len(xs) - 1))))]


def main() -> int:
    # SIGTERM (timeout, kill) must still stop the server processes in run_system's finally.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=1, help="A B C C B A cycles (each system runs twice per cycle)")
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--systems", nargs="+", default=["llama-server", "lcp-server", "dreamstage"])
    ap.add_argument("--tag", default="", help="suffix for the result file: serving-<date>[-tag].json")
    args = ap.parse_args()
    WORK.mkdir(parents=True, exist_ok=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    paths = {"model": model_path(), "lib": lib_dir()}
    systems = list(args.systems)
    if "llama-server" in systems:
        paths["llama-server"] = ensure_llama_server()
    if "lcp-server" in systems:
        py = ensure_lcp_venv()
        if py is None:
            systems.remove("lcp-server")
        else:
            paths["lcp-python"] = py
    order = []
    for _ in range(args.cycles):
        order += systems + systems[::-1]
    runs: list[dict] = []
    for streams in args.streams:
        for i, system in enumerate(order):
            log(f"{streams} stream(s): {system} (run {i + 1}/{len(order)})")
            res = run_system(system, streams, paths)
            res.update(system=system, streams=streams, seq=i)
            log(f"  {res['agg_tok_s']:.1f} tok/s aggregate, p50 ITL {1000 * pct(res['itl'], 50):.1f} ms, "
                f"load {res['loadavg_1m'][0]:.1f}"
                + (f", {res['short_streams']} SHORT streams" if res["short_streams"] else ""))
            runs.append(res)
    summary = summarize(runs, systems, args.streams)
    out = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": {**describe(), "platform": platform.platform()},
        "model": paths["model"].name, "gen_tokens": GEN_TOKENS, "threads": THREADS, "slot_ctx": SLOT_CTX,
        "order": order, "streams": args.streams, "summary": summary,
        "runs": [{k: v for k, v in r.items() if k not in ("itl", "ttft")} | {
            "itl_p50_ms": 1000 * pct(r["itl"], 50), "itl_p99_ms": 1000 * pct(r["itl"], 99),
            "ttft_max_ms": 1000 * max(r["ttft"] or [float("nan")])} for r in runs],
    }
    path = RESULTS / f"serving-{dt.date.today().isoformat()}{'-' + args.tag if args.tag else ''}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(render_table(summary, systems, args.streams))
    log(f"wrote {path.relative_to(ROOT)}")
    return 0


def summarize(runs: list[dict], systems: list[str], streams_list: list[int]) -> dict:
    out = {}
    for streams in streams_list:
        row = {}
        for system in systems:
            rs = [r for r in runs if r["system"] == system and r["streams"] == streams]
            itl = [g for r in rs for g in r["itl"]]
            row[system] = {
                "agg_tok_s": [round(r["agg_tok_s"], 1) for r in rs],
                "agg_tok_s_mean": round(statistics.mean(r["agg_tok_s"] for r in rs), 1),
                "itl_p50_ms": round(1000 * pct(itl, 50), 2), "itl_p99_ms": round(1000 * pct(itl, 99), 2),
                "tokens": [r["tokens"] for r in rs],
            }
        if "dreamstage" in row:
            ours = [r for r in runs if r["system"] == "dreamstage" and r["streams"] == streams]
            for other in systems:
                if other == "dreamstage":
                    continue
                theirs = [r for r in runs if r["system"] == other and r["streams"] == streams]
                # every pairing of our runs with theirs: the spread of the ratio
                ratios = [a["agg_tok_s"] / b["agg_tok_s"] for a in ours for b in theirs]
                row[f"ratio_vs_{other}"] = {"mean": round(statistics.mean(ratios), 3),
                                            "min": round(min(ratios), 3), "max": round(max(ratios), 3)}
        out[str(streams)] = row
    return out


def render_table(summary: dict, systems: list[str], streams_list: list[int]) -> str:
    lines = ["| streams | system | aggregate tok/s (runs) | p50 ITL ms | p99 ITL ms | dreamstage ratio (min-max) |",
             "|---|---|---|---|---|---|"]
    for streams in streams_list:
        row = summary[str(streams)]
        for system in systems:
            s = row[system]
            ratio = row.get(f"ratio_vs_{system}")
            rtxt = f"{ratio['mean']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})" if ratio else "-"
            runs = ", ".join(f"{x:.0f}" for x in s["agg_tok_s"])
            lines.append(f"| {streams} | {system} | {s['agg_tok_s_mean']:.0f} ({runs}) | {s['itl_p50_ms']:.1f} | "
                         f"{s['itl_p99_ms']:.1f} | {rtxt} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
