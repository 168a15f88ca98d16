#!/usr/bin/env python3
"""PyTorch + PEFT LoRA training throughput on the same shapes as dream_gpu_bench.

The baseline the dream stage is held against (issue: >= 1.0x PEFT): a
Llama-3.2-1B-shaped model (2048 wide, 16 blocks, 32/8 heads, FFN 8192, SmolLM2's
49,152-token vocabulary, tied head) with random bf16 weights, PEFT LoRA of the
given rank (alpha = 2 x rank) on q,v or all seven linear targets, AdamW, batch
1, one sequence of L random tokens per step, SDPA attention. Prints one JSON
object: median / min / max train tok/s and peak memory per configuration.

  peft_bench.py [--seqs 512,2048] [--ranks 8,16] [--targets qv,all] [--steps 10]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

TARGETS = {"qv": ["q_proj", "v_proj"],
           "all": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}


def run(seq: int, rank: int, targets: str, steps: int) -> dict:
    cfg = LlamaConfig(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=49152, tie_word_embeddings=True, rope_theta=500000.0,
                      max_position_embeddings=8192, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda"):   # random init on the GPU: on the host it took most of the bench's minutes
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=torch.bfloat16)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets],
                                             lora_dropout=0.0, bias="none"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    tps = sorted(seq / t for t in times)
    out = {"seq": seq, "rank": rank, "targets": targets, "steps": steps,
           "train_tok_s": {"median": statistics.median(tps), "min": tps[0], "max": tps[-1]},
           "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "loss_last": float(loss)}
    del model, opt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="512,2048")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--targets", default="qv,all")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    runs = []
    for targets in a.targets.split(","):
        for rank in (int(r) for r in a.ranks.split(",")):
            for seq in (int(s) for s in a.seqs.split(",")):
                runs.append(run(seq, rank, targets, a.steps))
                print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "runs": runs}))


if __name__ == "__main__":
    main()
