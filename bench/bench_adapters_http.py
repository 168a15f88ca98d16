"""Many LoRA adapters through the HTTP server: dreamstage against llama-server.

The questions (issue 46, "Measure"; on the CPU, or with --ngl on a GPU: bench/gpu/adapters_http.sh):
1. decode: with S concurrent streaming chat clients, what does every stream on its
   own adapter ("mixed") cost against every stream on one adapter ("one") and against
   the base, end to end through HTTP, for dreamstage and for llama-server?
2. prefix cache: with conversations on two adapters interleaved, how much of each
   prompt is reused from a slot's cache, now and as the old server did (flush on swap)?

    .venv/bin/python bench/bench_adapters_http.py [--streams 4 8] [--targets qv all]
        [--reps 2] [--gen 16] [--threads 1] [--systems dreamstage llama-server]
        [--convs 4 --turns 4] [--skip-decode] [--skip-prefix] [--tag TAG]
        [--model M.gguf] [--ngl N] [--out-dir DIR]

Decode. For each target set (q,v or all 7) and S, S random rank-8 LoRAs (B != 0) are
written with dreamstage.adapters.files.save_lora, and both servers run at once (idle
between their rounds), each with S slots, --threads threads and the default model:
  dreamstage    `python -m dreamstage serve --parallel S --threads T --state-dir TMP
                --no-drift-guard`, the adapters imported and promoted as a0..a{S-1}
                through POST /adapters {"name", "path"}; a request picks `model`:
                "base" / "a0" / "a{i}";
  llama-server  the pinned tree (vendor/llama.cpp, patched), built outside the repo by
                `--build-llama-server` (once; or when /tmp/llama_server_build/bin/llama-server is missing):
                    cmake -S vendor/llama.cpp -B /tmp/llama_server_build -DCMAKE_BUILD_TYPE=Release
                      -DGGML_NATIVE=ON (--ngl > 0: -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90)
                      -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_COMMON=ON
                      -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF
                      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
                      -DCMAKE_PROJECT_llama.cpp_INCLUDE=/tmp/llama_server_build/dream_ext.cmake
                    cmake --build /tmp/llama_server_build --target llama-server -j<cpus>
                where dream_ext.cmake (written by this script) adds dreamstage/ggml_ext to
                libllama, ggml-cpu (and ggml-cuda) as the repo's CMakeLists.txt does: the patched tree calls
                our hooks, which stay inert in llama-server;
                (--llama-server names another binary), run with `-np S -t T -tb T`, every
                LoRA as `--lora FILE` and `--lora-init-without-apply` (scale 0 at start);
                a request picks no `lora` / `[{"id": 0, "scale": 1}]` / `[{"id": i, "scale": 1}]`.
Each rep runs every (system, mode) once, the order rotated per rep. A round is S
streaming /v1/chat/completions requests at once (fixed prompts, greedy, ignore_eos,
max_tokens --gen). decode tok/s = tokens after each stream's first / the wall from
the first token of any stream to the last token of any stream (the prompt excluded);
ITL = the gaps between one stream's chunks. Medians over reps; mixed/one per system.

Prefix. An in-process dreamstage server (--convs slots) with adapters A and B holds
--convs conversations of --turns turns (16 greedy tokens a reply), conversation k on A
when k is even, on B when odd, in two traffic patterns: one request at a time
(consecutive requests alternate adapters) and each turn's requests at once. hit rate =
the change of dreamstage_prompt_tokens_cached over dreamstage_prompt_tokens in /metrics.
Modes, each from empty slots:
  one      every conversation on A (no alternation: the ceiling);
  after    A and B interleaved (today's server);
  before   the same, and before each request whose adapter differs from the previous
           request's (together: before each turn) Engine.forget_cached_prefixes() runs
           on the engine thread (a wrapper around the dream hook runs it at the next
           idle wake-up, <= 50 ms; the bench waits for it): what the single-adapter
           server did on every swap.
llama-server runs the `after` traffic too (a fresh server per pattern, each LoRA per
request); its hit rate is the sum of `timings.cache_n` over that of
`cache_n + prompt_n` of the answers.

Writes bench/results/adapters-http-cpu-<date>[-tag].json.
"""
from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np
from bench_serving import free_port, pct, wait_ready
from machine import describe

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LLAMA_SERVER = Path("/tmp/llama_server_build/bin/llama-server")
TARGETS = {"qv": ["attn_q", "attn_v"],
           "all": ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]}
RANK = 8
SLOT_CTX = 512
MODES = ("base", "one", "mixed")
SYSTEMS = ("dreamstage", "llama-server")
QUESTIONS = [
    "Tell me a long story about a lighthouse keeper.",
    "Explain in detail how a bicycle gear system works.",
    "Describe a walk through a busy market in the morning.",
    "Write a letter to a friend about your summer garden.",
    "Explain how bread rises, step by step.",
    "Describe the history of the printing press.",
    "Tell me about a journey across a desert on a camel.",
    "Explain why the sky changes colour at sunset.",
]
PREFIX_REPLY_TOKENS = 16


def _gpu_name() -> str:
    r = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    return r.stdout.strip() or r.stderr.strip()


def log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


# -- adapters -------------------------------------------------------------------------
def model_dims(model: Path) -> tuple[str, int, dict[str, tuple[int, int]]]:
    """(arch, n_layer, {target: (n_in, n_out)}) from the model file's metadata."""
    import gguf
    r = gguf.GGUFReader(str(model))
    arch = str(r.fields["general.architecture"].contents())

    def meta(key: str) -> int:
        return int(r.fields[f"{arch}.{key}"].contents())
    n_embd, n_ff = meta("embedding_length"), meta("feed_forward_length")
    n_kv = n_embd // meta("attention.head_count") * meta("attention.head_count_kv")
    dims = {"attn_q": (n_embd, n_embd), "attn_output": (n_embd, n_embd), "attn_k": (n_embd, n_kv),
            "attn_v": (n_embd, n_kv), "ffn_gate": (n_embd, n_ff), "ffn_up": (n_embd, n_ff), "ffn_down": (n_ff, n_embd)}
    return arch, meta("block_count"), dims


def write_loras(model: Path, out: Path, targets: list[str], count: int) -> list[Path]:
    """`count` random rank-8 LoRAs on every layer (B != 0: each moves the answers)."""
    from dreamstage.adapters.files import save_lora
    arch, n_layer, dims = model_dims(model)
    paths = []
    for i in range(count):
        rng = np.random.default_rng(100 + i)
        factors = {}
        for layer in range(n_layer):
            for t in targets:
                n_in, n_out = dims[t]
                factors[(layer, t)] = (rng.uniform(-1, 1, (RANK, n_in)) / np.sqrt(n_in),
                                       rng.normal(0, 0.02, (n_out, RANK)))
        paths.append(save_lora(out / f"a{i}.gguf", factors, alpha=2.0 * RANK, model_arch=arch))
    return paths


# -- servers --------------------------------------------------------------------------
class Proc:
    """A server process in its own session, stopped (SIGTERM, then SIGKILL) on close."""

    def __init__(self, argv: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen([a.replace("{port}", str(self.port)) for a in argv], stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._log.close()


DREAM_EXT = """# llama-server from the patched tree: our hooks' definitions, as CMakeLists.txt adds them
cmake_language(DEFER DIRECTORY "${{CMAKE_SOURCE_DIR}}" CALL dream_ext)
function(dream_ext)
    file(GLOB ext {repo}/dreamstage/ggml_ext/*.cpp)
    file(GLOB cpu {repo}/dreamstage/ggml_ext/cpu/*.cpp)
    target_sources(llama PRIVATE ${{ext}})
    target_include_directories(llama PRIVATE {repo}/dreamstage/ggml_ext {tree}/src {tree}/ggml/src)
    target_sources(ggml-cpu PRIVATE ${{cpu}})
    set_source_files_properties(${{ext}} TARGET_DIRECTORY llama PROPERTIES SKIP_UNITY_BUILD_INCLUSION ON)
    set_source_files_properties({repo}/dreamstage/ggml_ext/dream-info.cpp TARGET_DIRECTORY llama PROPERTIES
        COMPILE_DEFINITIONS "DREAM_PIN_VERSION=\\"bench\\";DREAM_PIN_COMMIT=\\"bench\\";DREAM_PATCHES=\\"bench\\"")
    if (TARGET ggml-cuda)
        file(GLOB cu {repo}/dreamstage/ggml_ext/cuda/*.cu)
        target_sources(ggml-cuda PRIVATE ${{cu}})
        target_include_directories(ggml-cuda PRIVATE {tree}/ggml/src/ggml-cuda)
    endif()
endfunction()
"""


def build_llama_server(exe: Path, cuda: bool) -> None:
    """Build llama-server from the patched pinned tree (DREAMSTAGE_LLAMA_TREE when set, as for the
    GPU machine's trimmed tree) in exe's grandparent folder (the docstring's commands; with CUDA
    for sm_90 when `cuda`)."""
    build = exe.parents[1]
    tree = Path(os.environ.get("DREAMSTAGE_LLAMA_TREE") or ROOT / "vendor" / "llama.cpp")
    build.mkdir(parents=True, exist_ok=True)
    (build / "dream_ext.cmake").write_text(DREAM_EXT.format(repo=ROOT, tree=tree))
    flags = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90"] if cuda else ["-DGGML_NATIVE=ON"]
    subprocess.run(["cmake", "-S", str(tree), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release", *flags,
                    "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TOOLS=ON", "-DLLAMA_BUILD_COMMON=ON",
                    "-DLLAMA_BUILD_APP=OFF", "-DLLAMA_BUILD_UI=OFF", "-DLLAMA_USE_PREBUILT_UI=OFF",
                    "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                    f"-DCMAKE_PROJECT_llama.cpp_INCLUDE={build / 'dream_ext.cmake'}"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", f"-j{os.cpu_count()}"], check=True,
                   stdout=subprocess.DEVNULL)


def start_dreamstage(model: Path, loras: list[Path], slots: int, threads: int, state: Path, logs: Path,
                     ngl: int = 0) -> Proc:
    p = Proc([sys.executable, "-m", "dreamstage", "serve", "--model", str(model), "--host", "127.0.0.1",
              "--port", "{port}", "--parallel", str(slots), "--ctx", str(SLOT_CTX * slots), "--threads", str(threads),
              "--state-dir", str(state), "--no-drift-guard", "--n-gpu-layers", str(ngl)], logs / "dreamstage.log")
    wait_ready(p.url, p.proc)
    for i, path in enumerate(loras):
        r = httpx.post(p.url + "/adapters", json={"name": f"a{i}", "path": str(path)}, timeout=120)
        if r.status_code != 201:
            p.close()
            raise RuntimeError(f"import of {path.name}: HTTP {r.status_code} {r.text[:300]}")
    return p


def start_llama_server(exe: Path, model: Path, loras: list[Path], slots: int, threads: int, logs: Path,
                       ngl: int = 0) -> Proc:
    argv = [str(exe), "-m", str(model), "--host", "127.0.0.1", "--port", "{port}", "-np", str(slots),
            "-c", str(SLOT_CTX * slots), "-t", str(threads), "-tb", str(threads), "--no-webui", "-ngl", str(ngl),
            "--lora-init-without-apply"]
    for path in loras:
        argv += ["--lora", str(path)]
    p = Proc(argv, logs / "llama-server.log")
    wait_ready(p.url, p.proc)
    return p


def selection(system: str, mode: str, stream: int) -> dict:
    """The request fields that pick the stream's adapter in `mode`."""
    adapter = {"base": None, "one": 0, "mixed": stream}[mode]
    if system == "dreamstage":
        return {"model": "base" if adapter is None else f"a{adapter}"}
    return {} if adapter is None else {"lora": [{"id": adapter, "scale": 1.0}]}


# -- decode rounds ----------------------------------------------------------------------
def sse_data(line: str) -> dict | None:
    """The JSON object of a server-sent `data:` line; None for any other line and for [DONE]."""
    payload = line[5:].strip() if line.startswith("data:") else "[DONE]"
    return None if payload == "[DONE]" else json.loads(payload)


async def chat_stream(client: httpx.AsyncClient, body: dict) -> dict:
    """One streaming chat request: when each chunk with content arrived, and why it ended."""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        arrivals = [(time.perf_counter(), line) async for line in r.aiter_lines()]
    choices = [(t, (event.get("choices") or [{}])[0]) for t, line in arrivals if (event := sse_data(line))]
    return {"stamps": [t for t, ch in choices if (ch.get("delta") or {}).get("content")],
            "finish": next((ch["finish_reason"] for _, ch in reversed(choices) if ch.get("finish_reason")), None)}


async def decode_round(url: str, system: str, mode: str, streams: int, gen: int) -> dict:
    bodies = [{"messages": [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}], "max_tokens": gen,
               "temperature": 0.0, "ignore_eos": True, "stream": True, **selection(system, mode, i)}
              for i in range(streams)]
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        runs = await asyncio.gather(*(chat_stream(client, b) for b in bodies))
    firsts = [r["stamps"][0] for r in runs if r["stamps"]]
    lasts = [r["stamps"][-1] for r in runs if r["stamps"]]
    window = max(lasts) - min(firsts)
    chunks = sum(len(r["stamps"]) for r in runs)
    gaps = [b - a for r in runs for a, b in zip(r["stamps"], r["stamps"][1:], strict=False)]
    return {"system": system, "mode": mode, "streams": streams, "chunks": chunks,
            "finish": sorted({str(r["finish"]) for r in runs}),
            # ignore_eos and max_tokens: every stream decodes `gen` tokens; a chunk may carry more than one
            "decode_tok_s": streams * (gen - 1) / window, "window_s": window,
            "itl_p50_ms": 1000 * pct(gaps, 50), "itl_p99_ms": 1000 * pct(gaps, 99), "load_1m": os.getloadavg()[0]}


def run_decode(args, model: Path, work: Path) -> list[dict]:
    rounds: list[dict] = []
    for targets in args.targets:
        for streams in args.streams:
            d = work / f"{targets}-{streams}"
            d.mkdir()
            loras = write_loras(model, d, TARGETS[targets], streams)
            procs: dict[str, Proc] = {}
            try:
                for system in args.systems:
                    log(f"{targets}, {streams} streams: starting {system}")
                    procs[system] = (start_dreamstage(model, loras, streams, args.threads, d / "state", work, args.ngl)
                                     if system == "dreamstage" else
                                     start_llama_server(args.llama_server, model, loras, streams, args.threads, work,
                                                        args.ngl))
                    asyncio.run(decode_round(procs[system].url, system, "mixed", streams, 4))   # warm-up
                pairs = [(s, m) for m in MODES for s in args.systems]
                for rep in range(args.reps):
                    k = rep % len(pairs)
                    for system, mode in pairs[k:] + pairs[:k]:
                        res = asyncio.run(decode_round(procs[system].url, system, mode, streams, args.gen))
                        res.update(targets=targets, rep=rep)
                        rounds.append(res)
                        log(f"  rep {rep} {system:12} {mode:5} {res['decode_tok_s']:6.1f} tok/s  "
                            f"ITL p50 {res['itl_p50_ms']:.0f} ms p99 {res['itl_p99_ms']:.0f} ms  "
                            f"load {res['load_1m']:.1f}")
            finally:
                for p in procs.values():
                    p.close()
    return rounds


def summarize_decode(rounds: list[dict], args) -> list[dict]:
    rows = []
    for targets in args.targets:
        for streams in args.streams:
            for system in args.systems:
                row: dict = {"targets": targets, "streams": streams, "system": system}
                for mode in MODES:
                    rs = [r for r in rounds if (r["targets"], r["streams"], r["system"], r["mode"])
                          == (targets, streams, system, mode)]
                    row[mode] = {"tok_s": round(statistics.median(r["decode_tok_s"] for r in rs), 1),
                                 "tok_s_reps": [round(r["decode_tok_s"], 1) for r in rs],
                                 "itl_p50_ms": round(statistics.median(r["itl_p50_ms"] for r in rs), 1),
                                 "itl_p99_ms": round(statistics.median(r["itl_p99_ms"] for r in rs), 1)}
                row["mixed_over_one"] = round(row["mixed"]["tok_s"] / row["one"]["tok_s"], 3)
                row["one_over_base"] = round(row["one"]["tok_s"] / row["base"]["tok_s"], 3)
                rows.append(row)
    return rows


def decode_table(rows: list[dict]) -> str:
    lines = ["| targets | S | system | base | one | mixed | mixed/one | ITL p50/p99 ms (base; one; mixed) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        itl = "; ".join(f"{r[m]['itl_p50_ms']:.0f}/{r[m]['itl_p99_ms']:.0f}" for m in MODES)
        lines.append(f"| {r['targets']} | {r['streams']} | {r['system']} | {r['base']['tok_s']:.0f} | "
                     f"{r['one']['tok_s']:.0f} | {r['mixed']['tok_s']:.0f} | {r['mixed_over_one']:.2f} | {itl} |")
    return "\n".join(lines)


# -- prefix cache -----------------------------------------------------------------------
class FlushOnSwap:
    """The dream hook, and on request the old server's swap: every idle slot's cached
    prefix dropped (Engine.forget_cached_prefixes) at the engine's next hook call."""

    def __init__(self, inner):
        self.inner = inner
        self.asked = threading.Event()
        self.done = threading.Event()
        self.cleared = 0

    def __getattr__(self, name):            # hold_admission and the rest: the scheduler's
        return getattr(self.inner, name)

    def after_batch(self, engine, idle: bool) -> None:
        if self.asked.is_set() and not engine.busy_slots():
            self.asked.clear()
            self.cleared += engine.forget_cached_prefixes()
            self.done.set()
        self.inner.after_batch(engine, idle)

    def flush(self) -> None:
        self.done.clear()
        self.asked.set()
        if not self.done.wait(30):
            raise RuntimeError("the engine did not flush within 30 s")


def counters(http: httpx.Client) -> tuple[int, int]:
    text = http.get("/metrics").text

    def value(name: str) -> int:
        m = re.search(rf"^{name}(?:_total)? (\S+)$", text, re.M)
        if m is None:
            raise RuntimeError(f"/metrics has no {name}")
        return int(float(m.group(1)))
    return value("dreamstage_prompt_tokens"), value("dreamstage_prompt_tokens_cached")


def conversations(http: httpx.Client, system: str, adapters: list[int], turns: int, together: bool,
                  before=None) -> tuple[int, int]:
    """Run the conversations (conversation k on adapter adapters[k]) turn by turn: one
    request at a time, or (together) each turn's requests at once. `before(adapter)`
    runs before each request (one at a time) or each turn (together, with None).
    Returns llama-server's (prompt tokens, cached) from its timings; (0, 0) for dreamstage."""
    history: list[list[dict]] = [[] for _ in adapters]
    totals = [0, 0]

    def ask(k: int, t: int) -> None:
        history[k].append({"role": "user", "content": f"{QUESTIONS[(k + t) % len(QUESTIONS)]} (part {t + 1})"})
        body = {"messages": history[k], "max_tokens": PREFIX_REPLY_TOKENS, "temperature": 0.0}
        body |= ({"model": f"a{adapters[k]}"} if system == "dreamstage"
                 else {"lora": [{"id": adapters[k], "scale": 1.0}]})
        r = http.post("/v1/chat/completions", json=body)
        r.raise_for_status()
        answer = r.json()
        history[k].append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        if system == "llama-server":
            totals[0] += answer["timings"]["prompt_n"] + answer["timings"]["cache_n"]
            totals[1] += answer["timings"]["cache_n"]
    for t in range(turns):
        if together:
            if before is not None:
                before(None)
            threads = [threading.Thread(target=ask, args=(k, t)) for k in range(len(adapters))]
            for th in threads:      # started in order: A, B, A, B reach the engine in turn
                th.start()
                time.sleep(0.01)
            for th in threads:
                th.join()
            continue
        for k, adapter in enumerate(adapters):
            if before is not None:
                before(adapter)
            ask(k, t)
    return totals[0], totals[1]


def run_prefix(args, model: Path, work: Path) -> dict:
    sys.path.insert(0, str(ROOT / "tests"))
    from background_server import BackgroundServer

    from dreamstage.server.settings import ServerSettings
    d = work / "prefix"
    d.mkdir()
    loras = write_loras(model, d, TARGETS["qv"], 2)
    alternating = [k % 2 for k in range(args.convs)]
    out: dict = {"convs": args.convs, "turns": args.turns, "reply_tokens": PREFIX_REPLY_TOKENS, "targets": "qv"}
    settings = ServerSettings(model=str(model), parallel=args.convs, ctx=SLOT_CTX * 2 * args.convs,
                              threads=args.threads, state_dir=str(d / "state"), drift_guard=False)
    with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
        for i, path in enumerate(loras):
            r = http.post("/adapters", json={"name": f"a{i}", "path": str(path)})
            if r.status_code != 201:
                raise RuntimeError(f"import of {path.name}: HTTP {r.status_code} {r.text[:300]}")
        hook = FlushOnSwap(srv.service.engine.hook)
        srv.service.engine.hook = hook
        last: list[int | None] = [None]

        def flush_on_swap(adapter: int | None) -> None:
            if adapter is None or (last[0] is not None and adapter != last[0]):
                hook.flush()
            last[0] = adapter
        for pattern, together in (("one_at_a_time", False), ("turns_together", True)):
            for mode, adapters, before in (("one", [0] * args.convs, None), ("after", alternating, None),
                                           ("before", alternating, flush_on_swap)):
                hook.flush()                    # every mode starts from empty slots
                last[0] = None
                p0, c0 = counters(http)
                conversations(http, "dreamstage", adapters, args.turns, together, before)
                p1, c1 = counters(http)
                slots = [(s["cached_tokens"], s["cached_adapter"]) for s in http.get("/slots").json()["slots"]]
                out[f"dreamstage_{pattern}_{mode}"] = {"prompt_tokens": p1 - p0, "cached": c1 - c0,
                                                       "hit_rate": round((c1 - c0) / (p1 - p0), 3),
                                                       "slots_after": slots}
                log(f"prefix dreamstage {pattern} {mode:6}: {c1 - c0}/{p1 - p0} cached "
                    f"({(c1 - c0) / (p1 - p0):.1%}); slots {slots}")
        out["flushes"] = hook.cleared
    if "llama-server" in args.systems:
        for pattern, together in (("one_at_a_time", False), ("turns_together", True)):
            p = start_llama_server(args.llama_server, model, loras, args.convs, args.threads, work)  # empty caches
            try:
                with httpx.Client(base_url=p.url, timeout=600) as http:
                    prompt, cached = conversations(http, "llama-server", alternating, args.turns, together)
            finally:
                p.close()
            out[f"llama-server_{pattern}_after"] = {"prompt_tokens": prompt, "cached": cached,
                                                    "hit_rate": round(cached / prompt, 3)}
            log(f"prefix llama-server {pattern} after: {cached}/{prompt} cached ({cached / prompt:.1%})")
    return out


def main() -> int:
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # still stop the servers (finally)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--targets", nargs="+", choices=sorted(TARGETS), default=["qv", "all"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--gen", type=int, default=16, help="tokens per stream (max_tokens, ignore_eos)")
    ap.add_argument("--threads", type=int, default=1, help="per server (2 on the 2 shared cores stalls for seconds)")
    ap.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS))
    ap.add_argument("--llama-server", type=Path, default=LLAMA_SERVER)
    ap.add_argument("--build-llama-server", action="store_true", help="(re)build it first (the docstring's commands)")
    ap.add_argument("--convs", type=int, default=4, help="prefix: conversations (and slots)")
    ap.add_argument("--turns", type=int, default=4, help="prefix: turns per conversation")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true")
    ap.add_argument("--tag", default="", help="suffix: adapters-http-<cpu|gpu>-<date>[-tag].json")
    ap.add_argument("--model", type=Path, help="a GGUF (default: the default model)")
    ap.add_argument("--ngl", type=int, default=0, help="layers on the GPU, both servers (> 0: gpu in the file name)")
    ap.add_argument("--out-dir", type=Path, default=RESULTS)
    args = ap.parse_args()
    if args.gen < 2 or args.reps < 1 or args.convs < 2 or args.turns < 1 or min(args.streams) < 1:
        ap.error("--gen >= 2, --reps >= 1, --convs >= 2, --turns >= 1 and every --streams >= 1")
    if "llama-server" in args.systems and (args.build_llama_server or not args.llama_server.is_file()):
        log(f"building llama-server into {args.llama_server.parents[1]} (2 cores: tens of minutes)")
        build_llama_server(args.llama_server, cuda=args.ngl > 0)
    from dreamstage.default_model import default_model
    model = args.model or default_model()
    out: dict = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                 "machine": {**describe(), "platform": platform.platform(),
                             "gpu": _gpu_name() if args.ngl > 0 else None},
                 "model": model.name, "rank": RANK, "threads": args.threads, "gen": args.gen, "reps": args.reps,
                 "slot_ctx": SLOT_CTX, "systems": args.systems, "ngl": args.ngl, "load_1m_start": os.getloadavg()[0]}
    with tempfile.TemporaryDirectory(prefix="adapters-http-") as tmp:
        work = Path(tmp)
        if not args.skip_decode:
            rounds = run_decode(args, model, work)
            out["decode"] = summarize_decode(rounds, args)
            out["rounds"] = rounds
            print(decode_table(out["decode"]))
        if not args.skip_prefix:
            out["prefix"] = run_prefix(args, model, work)
    out["load_1m_end"] = os.getloadavg()[0]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    device = "gpu" if args.ngl > 0 else "cpu"
    tag = f"-{args.tag}" if args.tag else ""
    path = args.out_dir / f"adapters-http-{device}-{dt.date.today().isoformat()}{tag}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    log(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
