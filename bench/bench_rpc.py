"""What splitting the resident model across RPC workers costs, on loopback.

`dreamstage rpc-worker` processes on this host hold part of the default
model's layers (and its output head); the same model also loads alone in this
process. For each set-up: greedy decode tok/s (one token a llama_decode after
a short prompt) and dream micro-step train tok/s (a window of one chunk, every
token a loss token, LoRA rank 8 on attn_q,attn_v of every layer, f32 training
cache), with the bytes that crossed the wire per decoded token and per
micro-step. The set-ups alternate, rep by rep, so a shared machine's load
drifts over all. Then, split: what a job pays to survive a failed worker
(copying the trainer's state out after each window) and what the recovery
costs (loading the model again, making the trainer again from the copy).
Writes bench/results/rpc-<cpu|gpu>[-1w]-<date>.json.

Set-ups (the model alone vs. split):
- CPU (default): two CPU workers (one thread each) hold the layers past the
  first quarter and the head (an even --tensor-split); this process's CPU the rest.
- `--ngl N`: the local device is a GPU. The model alone offloads N layers to
  it; split, the same N layers go to the workers and the local GPU in
  `--tensor-split` shares (workers first; default equal shares), the workers
  started with `--worker-device` (default CUDA0: the same GPU, same host).
- `--single-worker`: one worker holding half the layers (and the head; with
  --ngl, half of the N offloaded layers, the local GPU the other half).

    python bench/bench_rpc.py [--reps 3] [--chunk 64] [--decode 32]
    python bench/bench_rpc.py --ngl 99 [--single-worker] [--threads 8]
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))   # bench/, also under python -P (bench/gpu/run.sh)
from machine import describe

from dreamstage.serving import rpc
from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer

TEXT = ("Between decode batches the resident model takes one training micro-step on the text it was asked "
        "to learn, and the served adapter moves only when the engine promotes it. ")


WORKER_START_S = 60.0
T0 = time.monotonic()


def say(what: str) -> None:
    """A phase on stderr, so a run stopped from outside shows where it was."""
    print(f"[bench_rpc {time.monotonic() - T0:6.1f} s] {what}", file=sys.stderr, flush=True)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_workers(n: int, device: str, threads: int) -> tuple[list[subprocess.Popen], tuple[str, ...]]:
    """n workers listening, or SystemExit with what the first one that did not start said."""
    ports = [_port() for _ in range(n)]
    logs = [tempfile.TemporaryFile("w+") for _ in ports]      # a pipe would block a chatty worker
    safe = ["-P"] if sys.flags.safe_path else []             # as this process was run: not the cwd's package
    procs = [subprocess.Popen([sys.executable, *safe, "-m", "dreamstage", "rpc-worker", "--port", str(p), "--threads",
                               str(threads), "--device", device], stdout=subprocess.DEVNULL, stderr=log)
             for p, log in zip(ports, logs, strict=True)]
    deadline = time.monotonic() + WORKER_START_S
    for proc, p, log in zip(procs, ports, logs, strict=True):
        while rpc.probe(rpc.Endpoint("127.0.0.1", p), timeout_s=0.5):
            if proc.poll() is not None or time.monotonic() > deadline:
                for q in procs:
                    q.kill()
                log.seek(0)
                sys.exit(f"the rpc-worker on port {p} (--device {device}) did not start: {log.read()[-2000:]}")
            time.sleep(0.2)
    return procs, tuple(f"127.0.0.1:{p}" for p in ports)


def decode_rate(rm: ResidentModel, prompt: list[int], n: int) -> tuple[float, float]:
    """Greedy decode tok/s after the prompt, and the wire bytes per decoded token."""
    lc = rm.lc
    lc.llama_memory_clear(rm.memory, True)
    rm.decode_entries([(t, i, 0, i == len(prompt) - 1) for i, t in enumerate(prompt)])
    tok = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(rm.ctx, len(prompt) - 1), shape=(rm.n_vocab,)).argmax())
    b0, t0 = rpc.traffic().bytes, time.perf_counter()
    for i in range(n):
        rm.decode_entries([(tok, len(prompt) + i, 0, True)])
        tok = int(np.ctypeslib.as_array(lc.llama_get_logits_ith(rm.ctx, 0), shape=(rm.n_vocab,)).argmax())
    return n / (time.perf_counter() - t0), (rpc.traffic().bytes - b0) / n


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="a GGUF (default: the embedded default model)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--decode", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1, help="this process's CPU threads")
    ap.add_argument("--ngl", type=int, default=None, help="layers on the local GPU (and, split, on the workers)")
    ap.add_argument("--worker-device", default=None, help="the workers' ggml device (default CPU, or CUDA0 "
                                                          "with --ngl)")
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--tensor-split", default=None, help="the split's shares, workers first (default equal)")
    ap.add_argument("--single-worker", action="store_true", help="one worker holding half the layers")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.worker_device is None:
        args.worker_device = "CPU" if args.ngl is None else "CUDA0"
    return args


def _placement(args, n_layer: int, n_workers: int) -> tuple[int, tuple[float, ...], str]:
    """The split model's -ngl, --tensor-split and a description of where the layers are."""
    gpu = args.ngl is not None
    if args.tensor_split is not None:
        shares = rpc.parse_tensor_split(args.tensor_split)
    else:        # equal shares over the workers (and the local GPU)
        shares = (1.0,) * (n_workers + gpu)
    if gpu:
        where = (f"-ngl {args.ngl} over {n_workers} loopback worker(s) on {args.worker_device} and the local GPU "
                 f"(--tensor-split {','.join(f'{x:g}' for x in shares)}); the rest on the local CPU")
        return args.ngl, shares, where
    # counting the output head: the workers take the upper half, or all but the first quarter
    ngl = n_layer // 2 + 1 if n_workers == 1 else n_layer - n_layer // 4
    return ngl, shares, (f"layers 0-{n_layer - ngl} here, the rest and the output head over {n_workers} loopback "
                         f"worker(s) (-ngl {ngl}, --tensor-split {','.join(f'{x:g}' for x in shares)})")


def _measure(args, models: dict, trainers: dict, tokens: list[int]) -> dict[str, list[dict]]:
    c = args.chunk
    samples: dict[str, list[dict]] = {k: [] for k in models}
    for t in trainers.values():              # warm-up: the first step grows the compute buffers
        t.train_window(tokens[:c], np.ones(c, np.uint8))
    for rep in range(args.reps):
        say(f"rep {rep + 1} of {args.reps}")
        for name in ("single", "split", "split", "single"):
            (r,) = trainers[name].train_window(tokens[:c], np.ones(c, np.uint8))
            assert r.ok, r.message
            tok_s, wire = decode_rate(models[name], tokens[:16], args.decode)
            samples[name].append({"step_ms": r.ms, "rpc_bytes_per_step": r.rpc_bytes, "decode_tok_s": tok_s,
                                  "rpc_bytes_per_token": wire})
    return samples


def _resume_costs(model: ResidentModel, trainer: Trainer, reps: int) -> dict:
    """What holding a job across a failed worker costs when nothing fails: copying the trainer's
    state out after each window (ms, wire bytes); and once the worker is back: loading the model
    again and making the trainer again from the copy (docs/architecture/rpc.md)."""
    copies = []
    for _ in range(reps):
        b0, t0 = rpc.traffic().bytes, time.perf_counter()
        cp = trainer.checkpoint()
        copies.append(((time.perf_counter() - t0) * 1000, rpc.traffic().bytes - b0))
    t0 = time.perf_counter()
    model.reload()
    reload_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    trainer.reopen(cp)
    return {"checkpoint_ms_median": statistics.median(c[0] for c in copies),
            "checkpoint_rpc_bytes": statistics.median(c[1] for c in copies),
            "checkpoint_floats": int(cp.parameters.size + cp.moments.size),
            "reload_s": reload_s, "reopen_ms": (time.perf_counter() - t0) * 1000}


def main() -> None:
    args = _args()
    n_workers = 1 if args.single_worker else 2
    procs, endpoints = start_workers(n_workers, args.worker_device, args.worker_threads)
    say(f"{n_workers} worker(s) listening on {args.worker_device}")
    try:
        cfg = dict(model_path=args.model, n_ctx=512, n_seq=1, n_threads=args.threads, kv_type="f32")
        single = ResidentModel(ResidentConfig(**cfg, n_gpu_layers=0 if args.ngl is None else args.ngl))
        n_layer = single.lc.llama_model_n_layer(single.model)
        say("the model loaded alone")
        ngl, shares, where = _placement(args, n_layer, n_workers)
        split = ResidentModel(ResidentConfig(**cfg, rpc=endpoints, n_gpu_layers=ngl, tensor_split=shares))
        say(f"the model loaded split: {where}")
        tokens = single.tokenize(TEXT * 40)
        c = args.chunk
        lora = LoraConfig(targets="attn_q,attn_v")
        models = {"single": single, "split": split}
        trainers = {name: Trainer(rm, lora, cache_type="f32", window=c, chunk=c, optimizer=OptimizerConfig(lr=1e-4))
                    for name, rm in models.items()}
        samples = _measure(args, models, trainers, tokens)
        say("measured")
        # the machine's load_1m is the load at the end
        out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": describe(),
               "threads": args.threads, "worker_threads": args.worker_threads,
               "worker_device": args.worker_device, "ngl_single": args.ngl or 0, "workers": n_workers,
               "model": single.model_path.name, "n_layer": n_layer, "split": where,
               "chunk": c, "targets": lora.targets, "rank": lora.rank, "cache": "f32", "results": {}}
        for name, s in samples.items():
            ms = statistics.median(x["step_ms"] for x in s)
            out["results"][name] = {
                "n": len(s), "train_step_ms_median": ms, "train_tok_s": c / (ms / 1000),
                "decode_tok_s_median": statistics.median(x["decode_tok_s"] for x in s),
                "rpc_bytes_per_step_median": statistics.median(x["rpc_bytes_per_step"] for x in s),
                "rpc_bytes_per_decoded_token_median": statistics.median(x["rpc_bytes_per_token"] for x in s)}
        out["resume"] = _resume_costs(split, trainers["split"], args.reps)
        for t in trainers.values():
            t.close()
        split.close()
        single.close()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    kind = f"{'cpu' if args.ngl is None else 'gpu'}{'-1w' if args.single_worker else ''}"
    results = Path(__file__).resolve().parent / "results"
    path = Path(args.out or results / f"rpc-{kind}-{time.strftime('%Y-%m-%d')}.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({**out["results"], "resume": out["resume"]}, indent=2))


if __name__ == "__main__":
    main()
