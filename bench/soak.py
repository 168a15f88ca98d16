"""Soak: 8 streaming clients plus continuous training against one server on loopback.

    python bench/soak.py                    # 10 minutes, the default model
    python bench/soak.py --minutes 2 --out bench/results/soak-short.json

Starts `dreamstage serve` in its own process (8 slots, training on, a fresh
state directory), keeps 8 chat streams busy and a training job always running
(a new one is posted whenever the last ends), and records:
- per request: time to first token, every inter-token gap, errors;
- the longest time with no token arriving on any stream (a stall; a deadlock
  would show as one that never ends: past --stall-limit-s the run fails);
- the server's RSS every 5 s; growth is measured from the end of warm-up
  (the first fifth of the run, at least 60 s) to the end;
- the jobs' micro-steps and the pacer's figures.

Writes JSON (--out) and prints a summary. Exit status 1 when a check fails:
any request error, a stall over --stall-limit-s, or RSS growth of 5% or more.
Not part of the test suite: it runs for minutes by design.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

JSON_HEADERS = {"Content-Type": "application/json"}
QUESTIONS = ["Tell me about the moon.", "Write a short poem about rivers.", "Explain what a CPU does.",
             "List three fruits and their colours.", "Why is the sky blue?", "Describe a busy market.",
             "What is a good breakfast?", "How do birds fly?"]
LESSON = ("Tides are caused mostly by the moon's gravity pulling on the oceans. " * 12).strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def wait_healthy(url: str, server: subprocess.Popen, log_path: Path, timeout_s: float = 300) -> bool:
    """Waits for the server's /health; False (its log's tail on stderr) when it exited or never answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            print(log_path.read_text()[-3000:], file=sys.stderr)
            return False
        time.sleep(0.2)


def stop_server(server: subprocess.Popen) -> None:
    """SIGTERM, then a kill after two minutes."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(120)
    except subprocess.TimeoutExpired:
        server.kill()


def pct(values, q):
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


class Soak:
    def __init__(self, url: str, minutes: float, max_tokens: int):
        self.url, self.end = url, time.monotonic() + minutes * 60
        self.max_tokens = max_tokens
        self.lock = threading.Lock()
        self.ttft: list[float] = []
        self.gaps: list[float] = []
        self.latency: list[float] = []
        self.errors: list[str] = []
        self.requests = 0
        self.tokens = 0
        self.last_token = time.monotonic()
        self.max_stall = 0.0

    def client(self, i: int) -> None:
        with httpx.Client(base_url=self.url, timeout=600, headers=JSON_HEADERS) as c:
            k = 0
            while time.monotonic() < self.end:
                body = {"messages": [{"role": "user", "content": QUESTIONS[(i + k) % len(QUESTIONS)]}],
                        "max_tokens": self.max_tokens, "temperature": 0.7, "seed": i * 1000 + k, "stream": True}
                k += 1
                t0 = prev = time.monotonic()
                first = None
                try:
                    with c.stream("POST", "/v1/chat/completions", json=body) as r:
                        if r.status_code != 200:
                            r.read()
                            raise RuntimeError(f"status {r.status_code}: {r.text[:200]}")
                        done = False
                        for line in r.iter_lines():
                            if not line.startswith("data: "):
                                continue
                            if line == "data: [DONE]":
                                done = True
                                break
                            obj = json.loads(line[6:])
                            if "error" in obj:
                                raise RuntimeError(f"error event: {obj['error']}")
                            now = time.monotonic()
                            with self.lock:
                                if first is None:
                                    first = now
                                    self.ttft.append(now - t0)
                                else:
                                    self.gaps.append(now - prev)
                                self.tokens += 1
                                self.last_token = now
                            prev = now
                        if not done:
                            raise RuntimeError("stream ended without [DONE]")
                    with self.lock:
                        self.requests += 1
                        self.latency.append(time.monotonic() - t0)
                except Exception as e:  # noqa: BLE001 - every failure is a finding
                    with self.lock:
                        self.errors.append(f"client {i}: {type(e).__name__}: {e}")

    def watchdog(self, stall_limit: float, stop: threading.Event) -> None:
        while not stop.wait(0.5):
            with self.lock:
                stall = time.monotonic() - self.last_token
                self.max_stall = max(self.max_stall, stall)
            if stall > stall_limit:
                with self.lock:
                    self.errors.append(f"no token on any stream for {stall:.0f} s (deadlock?)")
                return


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=0, help="server CPU threads (default: all)")
    ap.add_argument("--model", default=None)
    ap.add_argument("--stall-limit-s", type=float, default=60.0)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/soak-<date>.json)")
    args = ap.parse_args(argv)

    state = Path(tempfile.mkdtemp(prefix="dreamstage-soak-"))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "dreamstage", "serve", "--port", str(port), "--state-dir", str(state / "state"),
           "--parallel", str(args.streams), "--ctx", str(512 * args.streams), "--threads", str(args.threads)]
    if args.model:
        cmd += ["--model", args.model]
    log = open(state / "server.log", "wb")
    server = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        if not wait_healthy(url, server, state / "server.log"):
            return 1
        return run(args, url, server, state)
    finally:
        stop_server(server)
        log.close()


def run(args, url: str, server: subprocess.Popen, state: Path) -> int:
    soak = Soak(url, args.minutes, args.max_tokens)
    stop = threading.Event()
    started = time.monotonic()
    warmup = max(60.0, args.minutes * 60 / 5)
    rss: list[tuple[float, float]] = []
    jobs: list[dict] = []
    threads = [threading.Thread(target=soak.client, args=(i,), daemon=True) for i in range(args.streams)]
    dog = threading.Thread(target=soak.watchdog, args=(args.stall_limit_s, stop), daemon=True)
    for t in (*threads, dog):
        t.start()
    with httpx.Client(base_url=url, timeout=60, headers=JSON_HEADERS) as c:
        job = None
        while time.monotonic() < soak.end and not (soak.errors and "deadlock" in soak.errors[-1]):
            if job is None or c.get(f"/train/{job}").json()["state"] not in ("queued", "starting", "running"):
                if job is not None:
                    jobs.append(c.get(f"/train/{job}").json())
                r = c.post("/train", json={"text": LESSON, "window": 64, "chunk": 32, "epochs": 20, "rank": 4,
                                           "promote": "never"})
                job = r.json()["id"] if r.status_code == 202 else None
            rss.append((time.monotonic() - started, rss_mib(server.pid)))
            time.sleep(5)
        if job is not None:
            jobs.append(c.get(f"/train/{job}").json())
    for t in threads:
        t.join(600)
    stop.set()
    dog.join(5)

    after_warmup = [m for t, m in rss if t >= warmup]
    base = after_warmup[0] if after_warmup else None
    growth = (after_warmup[-1] - base) / base if base else None
    steps = sum(j["progress"]["step"] for j in jobs)
    last_pacing = next((j["pacing"] for j in reversed(jobs) if j.get("pacing")), None)
    result = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{platform.node()} ({os.cpu_count()} CPUs), load average {os.getloadavg()[0]:.1f} at the end",
        "minutes": args.minutes, "streams": args.streams, "max_tokens": args.max_tokens,
        "requests": soak.requests, "tokens": soak.tokens, "errors": soak.errors[:20], "error_count": len(soak.errors),
        "ttft_s": {"p50": pct(soak.ttft, 0.5), "p95": pct(soak.ttft, 0.95), "p99": pct(soak.ttft, 0.99),
                   "max": max(soak.ttft, default=None)},
        "inter_token_s": {"p50": pct(soak.gaps, 0.5), "p95": pct(soak.gaps, 0.95), "p99": pct(soak.gaps, 0.99),
                          "max": max(soak.gaps, default=None)},
        "request_s": {"p50": pct(soak.latency, 0.5), "p95": pct(soak.latency, 0.95),
                      "mean": statistics.fmean(soak.latency) if soak.latency else None},
        "max_stall_s": soak.max_stall,
        "rss_mib": {"warmup_s": warmup, "after_warmup": base, "end": after_warmup[-1] if after_warmup else None,
                    "max": max((m for _, m in rss), default=None), "growth": growth,
                    "samples": [(round(t), round(m, 1)) for t, m in rss]},
        "training": {"jobs": len(jobs), "states": [j["state"] for j in jobs], "micro_steps": steps,
                     "last_pacing": last_pacing},
    }
    out = Path(args.out or f"bench/results/soak-{time.strftime('%Y-%m-%d')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    ok_growth = growth is not None and growth < 0.05
    ok = not soak.errors and ok_growth and soak.max_stall <= args.stall_limit_s
    print(f"soak {args.minutes:g} min, {args.streams} streams: {soak.requests} requests, {soak.tokens} tokens, "
          f"{len(soak.errors)} errors; TTFT p50/p95 {result['ttft_s']['p50']}/{result['ttft_s']['p95']} s; "
          f"inter-token p50/p95/p99/max {result['inter_token_s']['p50']}/{result['inter_token_s']['p95']}/"
          f"{result['inter_token_s']['p99']}/{result['inter_token_s']['max']} s; max stall {soak.max_stall:.1f} s; "
          f"RSS {base} -> {result['rss_mib']['end']} MiB ({'n/a' if growth is None else f'{growth:+.1%}'}); "
          f"{len(jobs)} jobs, {steps} micro-steps -> {out} [{'PASS' if ok else 'FAIL'}]; "
          f"server log and state in {state}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
