"""A worker host that vanishes (no FIN, no RST) under a decode: how long the decode
waits, with the connections' keepalive bound (rpc.keep_alive, `--rpc-dead-after`)
and with the kernel's defaults.

    python bench/bench_rpc_vanish.py --out bench/results/rpc-vanish.json

Linux only. The script runs itself again in a network namespace of its own
(`unshare -rn`: no privileges needed where user namespaces are allowed), makes a
second one for the worker's host, joined to the first by a veth pair
(10.9.0.1 here, 10.9.0.2 there), starts `dreamstage rpc-worker` there, loads the
tiny test model with its layers on the worker and decodes once. Then the
worker's end of the pair goes down: every packet to it is dropped without a
word (the sender's kernel sees it sent), and neither side hears a FIN or RST,
which is what a host that lost power or its network looks like from here. It
decodes again on a thread and records when the decode returned and whether
the process named the worker as failed, up to `--limit` seconds. Each variant
runs in fresh namespaces; `dead_after_s` null: the kernel's own timers.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))


def one(dead_after_s: float | None, limit_s: float) -> dict:
    """In the namespace: one vanish; dead_after_s None leaves the kernel's defaults."""
    import tempfile

    from test_rpc import SHAPE, TEXT
    from tiny_model import write_tiny_model

    from dreamstage.serving import rpc
    from dreamstage.serving.resident import ResidentConfig, ResidentModel

    host = subprocess.Popen(["unshare", "-n", "sleep", "3600"])     # the worker's host: a namespace of its own
    time.sleep(0.3)
    there = ["nsenter", "-t", str(host.pid), "-n"]
    for cmd in (["ip", "link", "add", "va", "type", "veth", "peer", "name", "vb", "netns", str(host.pid)],
                ["ip", "addr", "add", "10.9.0.1/24", "dev", "va"], ["ip", "link", "set", "va", "up"],
                [*there, "ip", "addr", "add", "10.9.0.2/24", "dev", "vb"], [*there, "ip", "link", "set", "vb", "up"]):
        subprocess.run(cmd, check=True)
    if dead_after_s is None:
        rpc.keep_alive = lambda fd, s: None            # type: ignore[assignment]  # the kernel's own timers
    endpoint = "10.9.0.2:50100"
    worker = subprocess.Popen([*there, sys.executable, "-m", "dreamstage", "rpc-worker", "--host", "10.9.0.2",
                               "--port", "50100", "--threads", "1", "--rpc-allow-remote"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while rpc.probe(rpc.Endpoint("10.9.0.2", 50100), timeout_s=0.5) is not None:
        if worker.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the worker did not start")
        time.sleep(0.1)
    with tempfile.TemporaryDirectory() as tmp:
        path = write_tiny_model(Path(tmp), quant="f32", shape=SHAPE)
        cfg = ResidentConfig(model_path=str(path), n_ctx=256, n_seq=1, n_threads=1, kv_type="f32", flash_attn="off",
                             rpc=(endpoint,), n_gpu_layers=SHAPE.n_layer,
                             rpc_dead_after_s=dead_after_s or ResidentConfig.rpc_dead_after_s)
        m = ResidentModel(cfg)
        toks = m.tokenize(TEXT)[:8]

        def decode(pos: int) -> int:
            batch = m.lc.llama_batch_init(len(toks), 0, 1)
            try:
                batch.n_tokens = len(toks)
                for i, t in enumerate(toks):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = t, pos + i, 1
                    batch.seq_id[i][0], batch.logits[i] = 0, i == len(toks) - 1
                status = int(m.lc.llama_decode(m.ctx, batch))
                m.lc.llama_synchronize(m.ctx)             # the worker's part may still be under way
                return status
            finally:
                m.lc.llama_batch_free(batch)
        assert decode(0) == 0
        subprocess.run([*there, "ip", "link", "set", "vb", "down"], check=True)   # the host vanishes
        out: dict = {}
        t0 = time.monotonic()

        def run() -> None:
            out["status"] = decode(len(toks))
            out["returned_s"] = round(time.monotonic() - t0, 2)
        th = threading.Thread(target=run, daemon=True)
        th.start()
        th.join(limit_s)
        row = {"dead_after_s": dead_after_s, "limit_s": limit_s, "returned": not th.is_alive(),
               "returned_s": out.get("returned_s"), "decode_status": out.get("status"),
               "worker_named_failed": rpc.failed_worker((endpoint,)) == endpoint}
        print(json.dumps(row), flush=True)
        for p in (worker, host):
            p.kill()
        os._exit(0)                                    # a decode still waiting would hold the process


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench/results/rpc-vanish.json")
    ap.add_argument("--dead-after", type=float, nargs="*", default=[5.0, 30.0])
    ap.add_argument("--limit", type=float, default=120.0)
    ap.add_argument("--inner", type=float, default=None, help=argparse.SUPPRESS)   # dead_after_s in the namespace
    args = ap.parse_args()
    if args.inner is not None:
        one(args.inner if args.inner > 0 else None, args.limit)
        return
    rows = []
    for d in [*args.dead_after, 0.0]:                  # 0: the kernel's defaults
        r = subprocess.run(["unshare", "-rn", sys.executable, __file__, "--inner", str(d), "--limit", str(args.limit)],
                           capture_output=True, text=True, timeout=args.limit + 120, cwd=ROOT)
        line = [x for x in r.stdout.splitlines() if x.startswith("{")]
        rows.append(json.loads(line[-1]) if line else {"dead_after_s": d, "error": r.stderr[-2000:]})
        print(rows[-1], flush=True)
    out = {"bench": "rpc_vanish", "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
           "kernel_tcp_retries2": Path("/proc/sys/net/ipv4/tcp_retries2").read_text().strip(), "rows": rows}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
