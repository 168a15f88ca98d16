"""Train tok/s on the CPU, side by side, on the default model (SmolLM2-135M):

- dream: the dream stage's micro-step (LoRA rank 8 on attn_q,attn_v, every
  layer, q8_0 training cache, window = chunk = seq, every token a loss token,
  one AdamW update per step), on the Q4_1 model as served;
- finetune: upstream `llama-finetune`, a full fine-tune of an F32 copy of the
  same model (ctx = batch = ubatch = seq), built from the pinned upstream tree;
- peft: PyTorch + PEFT, the same model dequantized into `transformers`
  (float32), LoRA of the same rank and targets, AdamW, batch 1, seq tokens.

All with the same thread count. Each measurement is its own process, and the
order is interleaved (dream finetune peft peft finetune dream, per round), so
drift in a shared machine's load spreads over all three. Besides wall-clock
tok/s, each reports tokens per CPU-second of the training steps (for
llama-finetune: the slope between a short and a longer run, so loading is not
counted), the fairer figure when other programs share the cores. Writes JSON.

  .venv/bin/python bench/bench_cpu_train.py --finetune PATH/llama-finetune \\
      --peft-python PATH/venv/bin/python [--threads 2] [--seq 256] [--steps 6] [--rounds 2]

The PEFT side needs a separate venv with torch (CPU), transformers, peft and
gguf; the finetune binary is built from the unpatched upstream tree (see
docs/benchmarks.md, "CPU training speed against PEFT and llama-finetune").
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from machine import describe

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / ".work"
TEXT = ("Between decode batches the resident model takes one training micro-step on the text it was asked "
        "to learn, and the served adapter moves only when the engine promotes it. ")


def _default_model() -> Path:
    from dreamstage.default_model import default_model
    return default_model()


def prepare_f32() -> Path:
    """An F32 copy of the default model (llama.cpp's own dequantizer), for llama-finetune."""
    out = WORK / "smollm2-135m-f32.gguf"
    if out.is_file():
        return out
    import ctypes

    from dreamstage import native
    lc = native.llama_cpp().llama_cpp
    params = lc.llama_model_quantize_default_params()
    params.ftype = 0            # LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    WORK.mkdir(parents=True, exist_ok=True)
    rc = lc.llama_model_quantize(str(_default_model()).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise SystemExit(f"llama_model_quantize to F32 failed ({rc})")
    return out


def one_dream(threads: int, seq: int, steps: int) -> dict:
    import numpy as np

    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    from dreamstage.training.walk.trainer import LoraConfig, OptimizerConfig, Trainer
    rm = ResidentModel(ResidentConfig(n_ctx=max(512, seq), n_seq=1, n_threads=threads))
    toks = rm.tokenize(TEXT * 80)
    tr = Trainer(rm, LoraConfig(rank=8, targets="attn_q,attn_v"), cache_type="q8_0", window=seq, chunk=seq,
                 optimizer=OptimizerConfig(lr=1e-4))
    mask = np.ones(seq, np.uint8)
    tr.train_window(toks[:seq], mask)     # warm-up: the first step sizes the compute buffer
    walls, cpu = [], []
    for i in range(steps):
        w = toks[(i + 1) * 7:(i + 1) * 7 + seq]
        t0, c0 = time.perf_counter(), time.process_time()
        (r,) = tr.train_window(w, mask)
        walls.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
        assert r.ok, r.message
    tr.close()
    rm.close()
    return {"tok_s": seq * steps / sum(walls), "tok_per_cpu_s": seq * steps / sum(cpu),
            "step_ms_median": 1000 * statistics.median(walls), "cpu_ms_median": 1000 * statistics.median(cpu)}


PEFT_SCRIPT = r"""
import json, sys, time, statistics, torch
from pathlib import Path
from transformers import AutoModelForCausalLM
from peft import LoraConfig, get_peft_model
threads, seq, steps, model_path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
torch.set_num_threads(threads)
torch.manual_seed(0)
m = AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name, torch_dtype=torch.float32)
m = get_peft_model(m, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                 bias="none"))
opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, m.config.vocab_size, (1, seq))
def step():
    loss = m(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
step()
walls, cpu = [], []
for _ in range(steps):
    t0, c0 = time.perf_counter(), time.process_time(); step()
    walls.append(time.perf_counter() - t0); cpu.append(time.process_time() - c0)
print(json.dumps({"tok_s": seq * steps / sum(walls), "tok_per_cpu_s": seq * steps / sum(cpu),
                  "step_ms_median": 1000 * statistics.median(walls), "torch": torch.__version__}))
"""


def one_peft(python: str, threads: int, seq: int, steps: int) -> dict:
    out = subprocess.run([python, "-c", PEFT_SCRIPT, str(threads), str(seq), str(steps), str(_default_model())],
                         capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"peft run failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _finetune_run(binary: str, f32: Path, threads: int, seq: int, n_data: int) -> tuple[int, int, float]:
    """One llama-finetune epoch over about n_data windows of seq tokens (its
    dataset steps by seq / 2); returns (windows trained, seconds from its
    progress line, CPU seconds of the process)."""
    text = WORK / f"finetune-{seq}-{n_data}.txt"
    # TEXT is about 30 tokens; seq + (n_data - 1) * seq / 2 tokens are needed
    text.write_text(TEXT * ((seq + (n_data - 1) * seq // 2) // 25 + 2))
    cmd = [binary, "-m", str(f32), "-f", str(text), "-c", str(seq), "-b", str(seq), "-ub", str(seq),
           "-t", str(threads), "-tb", str(threads), "-epochs", "1", "-ngl", "0", "-val-split", "0",
           "-o", str(WORK / "finetuned.gguf")]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    log = out.stdout + out.stderr
    if out.returncode != 0:
        raise SystemExit(f"llama-finetune failed: {log[-2000:]}")
    m = re.findall(r"train: \[.*?data=\s*(\d+)/\s*(\d+).*?t=(\d+):(\d+):(\d+)", log)
    if not m:
        raise SystemExit(f"no progress line in llama-finetune's output: {log[-1500:]}")
    done, _total, hh, mm, ss = (int(x) for x in m[-1])
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    return done, max(1, 3600 * hh + 60 * mm + ss), cpu


def one_finetune(binary: str, f32: Path, threads: int, seq: int, steps: int) -> dict:
    """Wall tok/s from the longer run's progress line (whole seconds, loading
    excluded); CPU tok/s from the difference of a short and a longer run."""
    d1, _s1, c1 = _finetune_run(binary, f32, threads, seq, 2)
    d2, s2, c2 = _finetune_run(binary, f32, threads, seq, 2 + steps)
    return {"tok_s": d2 * seq / s2, "tok_per_cpu_s": (d2 - d1) * seq / max(1e-9, c2 - c1),
            "datapoints": [d1, d2], "train_s": s2, "cpu_s": [c1, c2]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--one", choices=["dream"], help=argparse.SUPPRESS)
    ap.add_argument("--finetune", help="path of upstream llama-finetune")
    ap.add_argument("--peft-python", help="python of a venv with torch, transformers, peft, gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "cpu_train.json"))
    a = ap.parse_args()
    if a.one == "dream":
        print(json.dumps(one_dream(a.threads, a.seq, a.steps)))
        return
    f32 = prepare_f32() if a.finetune else None
    runs: dict[str, list[dict]] = {"dream": [], "finetune": [], "peft": []}
    order = ["dream", "finetune", "peft"]
    for r in range(a.rounds):
        for name in (order if r % 2 == 0 else order[::-1]) + (order[::-1] if r % 2 == 0 else order):
            if name == "finetune" and not a.finetune or name == "peft" and not a.peft_python:
                continue
            load = os.getloadavg()[0]
            if name == "dream":
                p = subprocess.run([sys.executable, __file__, "--one", "dream", "--threads", str(a.threads),
                                    "--seq", str(a.seq), "--steps", str(a.steps)], capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(p.stderr[-2000:])
                res = json.loads(p.stdout.strip().splitlines()[-1])
            elif name == "finetune":
                res = one_finetune(a.finetune, f32, a.threads, a.seq, a.steps)
            else:
                res = one_peft(a.peft_python, a.threads, a.seq, a.steps)
            res["load_avg_1m"] = load
            runs[name].append(res)
            print(name, json.dumps(res), flush=True)
    summary = {k: {"tok_s_median": statistics.median(x["tok_s"] for x in v), "tok_s_min": min(x["tok_s"] for x in v),
                   "tok_s_max": max(x["tok_s"] for x in v),
                   "tok_per_cpu_s_median": statistics.median(x["tok_per_cpu_s"] for x in v), "n": len(v)}
               for k, v in runs.items() if v}
    ratios = {}
    for k in ("finetune", "peft"):
        if k in summary:
            ratios[f"dream_over_{k}_wall"] = summary["dream"]["tok_s_median"] / summary[k]["tok_s_median"]
            ratios[f"dream_over_{k}_cpu"] = (summary["dream"]["tok_per_cpu_s_median"]
                                             / summary[k]["tok_per_cpu_s_median"])
    out = {"date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "machine": describe(),
           "threads": a.threads, "seq": a.seq, "steps": a.steps, "rounds": a.rounds, "summary": summary,
           "ratios": ratios, "runs": runs}
    Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({"summary": summary, "ratios": ratios}, indent=2))


if __name__ == "__main__":
    main()
