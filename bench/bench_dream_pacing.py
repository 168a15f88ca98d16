"""Pacing on the real server: does chat keep its bound and the job its share, for every load shape?

For each load shape (idle; one client sending short requests back to back;
2, 4 and 8 streaming clients; bursts with pauses) this runs the same closed
loop of chat clients twice, interleaved: without a job, then with a text
job paced by `max_slowdown` 0.10 (the default) and the default
`max_pause_ms` 250. It reports, per shape:

- the clients' decode tok/s, time to first token (p50) and inter-token gap
  (p95), with and without the job, and the slowdown between the two;
- the pacer's own `realized_slowdown` against the bound;
- the job's share of the wall time, what the bound and the idle time
  allowed it, its train tok/s (tokens walked per second of wall time);
- the pause per micro-step (p50, p95, max) and the chunk and thread count
  the shaper chose.

    .venv/bin/python bench/bench_dream_pacing.py [--seconds 15] [--threads 0] [--shapes idle,1x24,...]

The machine is whatever it is: the project VM is shared, so the load
average is recorded, and the client-side slowdown between two short
segments carries that noise. Writes bench/results/dream-pacing-<date>.json.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import os
import platform
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # background_server

from background_server import BackgroundServer

from dreamstage.server.settings import ServerSettings

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results"
PROMPTS = ["Tell me a long story about a lighthouse keeper.", "Explain how bread is made, step by step.",
           "Describe a walk through a busy market.", "Write about the history of sailing ships."]
LESSON = ("Dreamstage keeps one model resident. Between decode batches it trains a small adapter on what "
          "users post to the train route, and serving never stops. ") * 8


@dataclass(frozen=True)
class Shape:
    name: str
    clients: int
    max_tokens: int = 64
    burst_on: float = 0.0      # > 0: clients talk this long, then pause burst_off
    burst_off: float = 0.0


SHAPES = {
    "idle": Shape("idle", 0),
    "1x24": Shape("one client, 24-token requests back to back", 1, max_tokens=24),
    "2": Shape("2 streaming clients", 2),
    "4": Shape("4 streaming clients", 4),
    "8": Shape("8 streaming clients", 8),
    "bursts": Shape("4 clients, bursts of 4 s with 4 s pauses", 4, max_tokens=32, burst_on=4.0, burst_off=4.0),
}


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[max(1, math.ceil(q / 100 * len(s))) - 1]            # nearest rank


def load(url: str, shape: Shape, seconds: float) -> dict:
    """Closed loop: each client streams request after request until time is up."""
    tokens = [0] * shape.clients
    ttft: list[float] = []
    gaps: list[float] = []
    lock = threading.Lock()
    t0 = time.monotonic()
    stop_at = t0 + seconds

    def talking(now: float) -> bool:
        if not shape.burst_on:
            return True
        return (now - t0) % (shape.burst_on + shape.burst_off) < shape.burst_on

    def client(i: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as c:
            while (now := time.monotonic()) < stop_at:
                if not talking(now):
                    time.sleep(0.05)
                    continue
                body = {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
                        "max_tokens": shape.max_tokens, "temperature": 0, "stream": True}
                sent, last, mine, first = time.monotonic(), None, [], None
                with c.stream("POST", "/v1/chat/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                            now = time.monotonic()
                            if first is None:
                                first = now - sent
                            else:
                                mine.append(now - last)
                            last = now
                            tokens[i] += 1
                with lock:
                    if first is not None:
                        ttft.append(first)
                    gaps.extend(mine)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(shape.clients)]
    for t in threads:
        t.start()
    if not threads:
        time.sleep(seconds)
    for t in threads:
        t.join()
    wall = time.monotonic() - t0
    return {"tokens": sum(tokens), "seconds": wall, "tok_s": sum(tokens) / wall if shape.clients else None,
            "requests": len(ttft), "ttft_ms_p50": (pct(ttft, 50) or 0) * 1000 if ttft else None,
            "itl_ms_p95": (pct(gaps, 95) or 0) * 1000 if gaps else None}


def _load_child(url: str, shape: Shape, seconds: float, q) -> None:
    q.put(load(url, shape, seconds))


def load_apart(url: str, shape: Shape, seconds: float) -> dict:
    """The same closed loop from a separate process, as real clients are: its
    threads then do not take the server process's interpreter lock."""
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_load_child, args=(url, shape, seconds, q))
    child.start()
    out = q.get()
    child.join()
    return out


LOAD = {"load": load}


def ledger(srv: BackgroundServer) -> tuple[float, float, float, float]:
    """(clock, active seconds, dream seconds, idle seconds) of the running job's
    pacer (`Pacer.ledger`), read in process: the share over the clients' own
    window, without the job's start and the idle tail after them that the
    job's figures include."""
    pacer = srv.service.scheduler._pacer        # the scheduler's pacer of the running job
    if pacer is None:
        raise RuntimeError("no job is being paced")
    return pacer.ledger()


def with_job(srv: BackgroundServer, http: httpx.Client, shape: Shape, seconds: float, pacing: dict) -> dict:
    url = srv.url
    r = http.post("/train", json={"text": LESSON, "window": 64, "chunk": 64, "epochs": 1000, "promote": "never",
                                  **pacing})
    r.raise_for_status()
    jid = r.json()["id"]
    while http.get(f"/train/{jid}").json()["progress"]["step"] < 1:    # trainer built, first step taken
        time.sleep(0.05)
    walked0 = http.get(f"/train/{jid}").json()["progress"]["walked"]
    l0 = ledger(srv)
    client = LOAD["load"](url, shape, seconds)
    l1 = ledger(srv)
    time.sleep(1.1)                                                     # the figures are flushed every second
    job = http.get(f"/train/{jid}").json()
    # a body-less POST says application/json, or the server refuses it (cross-site guard)
    http.post(f"/train/{jid}/cancel", headers={"Content-Type": "application/json"}).raise_for_status()
    # the native step time of each ok receipt, beside the pause the pacer measured around it
    # (a drift measurement's receipt is "ok" too, and its `ms` is the whole
    # measurement's decode time over many pauses: not a step)
    native = [r["ms"] for r in srv.service.store.receipts(jid, status="ok") if r.get("kind") is None]
    stopped = [r["ms"] for r in srv.service.store.receipts(jid, status="stopped")]
    f = job["pacing"]
    bound = pacing.get("max_slowdown", 0.10)
    # What the bound and the idle time allow: the bound's part of chat's time (the
    # wall time with a request in the system) and all of the idle time, as the
    # pacing simulation (tests/test_pacing.py) defines it. The older figure, kept as
    # *_batch_time, took chat's time as the pacer's active seconds (its batches and
    # steps) and counted the rest, the serving loop's own work between batches
    # included, as idle.
    allowed = allowance(bound, f["wall_s"], f["idle_s"])
    allowed_batch_time = allowance_batch_time(bound, f["wall_s"], f["active_s"])
    return {"client": client, "pacer": f,
            "native_step_ms": {"p50": pct(native, 50), "p95": pct(native, 95), "max": max(native, default=None),
                               "steps": len(native)},
            # steps stopped at the deadline (each gone on with by the next step): how many, the
            # native time of those parts (how far past the deadline the segment they were on
            # took them), and that time's share of the job's
            "stopped": {"steps": len(stopped), "ms_max": max(stopped, default=None),
                        "share_of_dream": ((job["progress"]["stopped_ms"] / 1000.0 / f["dream_s"])
                                           if f["dream_s"] else None)},
            "job": {"walked_tok_s_wall": (job["progress"]["walked"] - walked0) / client["seconds"],
                    "train_tok_s": job["progress"]["train_tok_s"],
                    "dream_share_of_wall": f["job_share_of_wall"],
                    "allowed_share_of_wall": allowed / f["wall_s"],
                    "share_vs_allowed": f["dream_s"] / allowed if allowed else None,
                    # the same over the clients' window only
                    "share_vs_allowed_in_load": share_in(l0, l1, bound),
                    "share_vs_allowed_batch_time": f["dream_s"] / allowed_batch_time if allowed_batch_time else None,
                    "share_vs_allowed_in_load_batch_time": share_in(l0, l1, bound, batch_time=True)}}


def allowance(bound: float, wall: float, idle: float) -> float:
    """Training time the promise allows over `wall` seconds of which `idle` had
    no request in the system: the bound's part of the rest, and all the idle."""
    return bound * max(0.0, wall - idle) + idle


def allowance_batch_time(bound: float, wall: float, active: float) -> float:
    """The older allowance: chat's time taken as the
    pacer's batches and steps, the rest of the wall counted as idle."""
    return bound * active + max(0.0, wall - active)


def share_in(l0: tuple[float, ...], l1: tuple[float, ...], bound: float, batch_time: bool = False) -> float | None:
    wall, active, dream, idle = (b - a for a, b in zip(l0, l1, strict=True))
    allowed = allowance_batch_time(bound, wall, active) if batch_time else allowance(bound, wall, idle)
    return dream / allowed if allowed > 0 else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=15.0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=None)
    ap.add_argument("--clients-apart", action="store_true",
                    help="run the chat clients in a separate process (default: threads of the server's process)")
    args = ap.parse_args()
    if args.clients_apart:
        LOAD["load"] = load_apart
    pacing = {"max_slowdown": 0.10, "max_pause_ms": 250}
    shapes = [SHAPES[s] for s in args.shapes.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as state:
        settings = ServerSettings(ctx=4096, parallel=8, threads=args.threads, state_dir=state)
        with BackgroundServer(settings) as srv, httpx.Client(base_url=srv.url, timeout=600) as http:
            load(srv.url, SHAPES["2"], 3.0)                                # warm-up
            for shape in shapes:
                # interleaved: without, then with, on the same warm server
                base = LOAD["load"](srv.url, shape, args.seconds)
                job = with_job(srv, http, shape, args.seconds, pacing)
                out = {"without_job": base, "with_job": job}
                if shape.clients and base["tok_s"]:
                    out["client_slowdown"] = 1.0 - job["client"]["tok_s"] / base["tok_s"]
                results[shape.name] = out
                p, j = job["pacer"], job["job"]
                print(f"{shape.name:44s} chat {base['tok_s'] or 0:5.1f} -> {job['client']['tok_s'] or 0:5.1f} tok/s "
                      f"(client {out.get('client_slowdown', 0):+.1%}, pacer {p['realized_slowdown'] or 0:.3f})  "
                      f"job {j['dream_share_of_wall']:.2f} of wall ({j['share_vs_allowed'] or 0:.2f} of allowed; "
                      f"{j['share_vs_allowed_in_load'] or 0:.2f} in the clients' window)  "
                      f"pause p50/p95/max {p['micro_step_ms_p50'] or 0:.0f}/{p['micro_step_ms_p95'] or 0:.0f}/"
                      f"{p['micro_step_ms_max'] or 0:.0f} ms (over {p['pauses_over_max']}, stopped "
                      f"{job['stopped']['steps']} of {job['native_step_ms']['steps'] + job['stopped']['steps']})  "
                      f"chunk {p['step_chunk']} threads {p['dream_threads']}",
                      flush=True)
    result = {"date": dt.date.today().isoformat(), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_average_at_end": os.getloadavg(), "seconds_per_segment": args.seconds,
              "threads": args.threads or os.cpu_count(), "pacing": pacing,
              "clients": "a separate process" if args.clients_apart else "threads of the server's process",
              "shapes": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = Path(args.out) if args.out else RESULTS / f"dream-pacing-{result['date']}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
