#!/usr/bin/env python3
"""PyTorch + PEFT LoRA training throughput on the same shapes as dream_gpu_bench.

The baseline the dream stage is held against (issue: >= 1.0x PEFT): a
Llama-3.2-1B-shaped model (2048 wide, 16 blocks, 32/8 heads, FFN 8192, SmolLM2's
49,152-token vocabulary, tied head) with random bf16 weights, PEFT LoRA of the
given rank (alpha = 2 x rank) on q,v or all seven linear targets, AdamW, batch
1, one sequence of L random tokens per step, SDPA attention. Prints one JSON
object: median / min / max train tok/s and peak memory per configuration.

  peft_bench.py [--seqs 512,2048] [--ranks 8,16] [--targets qv,all] [--steps 10] [--liger] [--shape 1b|8b] [--gpus N]

--liger applies liger-kernel's Llama kernels first (RoPE, RMSNorm, SwiGLU, fused linear cross-entropy):
the stronger anchor. Each row also gives its model FLOP/s utilisation against --peak-tflops (the
card's dense bf16 rate; 989 for an H100 SXM) with step_flops, the count dream_gpu_bench uses.
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


# hidden, layers, heads, K/V heads, FFN, vocabulary (SmolLM2's, as make_model.py writes), tied head
SHAPES = {"1b": (2048, 16, 32, 8, 8192, 49152, True), "8b": (4096, 32, 32, 8, 14336, 49152, False)}


def step_flops(seq: int, shape: str = "1b") -> float:
    """The model FLOPs of one LoRA training step on `seq` tokens, in multiply-adds x 2: each frozen
    product forward and its input's gradient (2 x), the LoRA's own left out; causal attention's QK^T
    and PV over half the square, forward and its four backward products (3 x)."""
    hidden, layers, heads, kv_heads, ffn, vocab, _ = SHAPES[shape]
    head = hidden // heads
    per_layer = hidden * hidden * 2 + hidden * head * kv_heads * 2 + 3 * hidden * ffn   # q,o + k,v + gate,up,down
    products = seq * (layers * per_layer + hidden * vocab)
    attention = layers * heads * head * seq * seq        # QK^T and PV, causal half: 2 x 0.5 x seq^2 x head
    return 2.0 * (2.0 * products + 3.0 * attention)


def split_over_gpus(model, gpus: int):
    """The decoder's blocks in equal runs over `gpus` GPUs (accelerate's hooks move the hidden states
    between them): what device_map="auto" does for a model that would fit one card."""
    from accelerate import dispatch_model
    layers = model.config.num_hidden_layers
    where = {f"model.layers.{i}": i * gpus // layers for i in range(layers)}
    where.update({"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": gpus - 1, "lm_head": gpus - 1})
    return dispatch_model(model, device_map=where)


def run(seq: int, rank: int, targets: str, steps: int, shape: str = "1b", gpus: int = 1) -> dict:
    hidden, layers, heads, kv_heads, ffn, vocab, tied = SHAPES[shape]
    cfg = LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=ffn, vocab_size=vocab, tie_word_embeddings=tied,
                      rope_theta=500000.0,
                      max_position_embeddings=8192, torch_dtype=torch.bfloat16)
    torch.manual_seed(0)
    with torch.device("cuda"):   # random init on the GPU: on the host it took most of the bench's minutes
        model = LlamaForCausalLM(cfg)
    model = model.to(dtype=torch.bfloat16)
    if gpus > 1:
        model = split_over_gpus(model, gpus)
    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS[targets],
                                             lora_dropout=0.0, bias="none"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (1, seq), device="cuda")
    for d in range(gpus):
        torch.cuda.reset_peak_memory_stats(d)
    times = []
    for i in range(steps + 3):
        for d in range(gpus):
            torch.cuda.synchronize(d)
        t0 = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for d in range(gpus):
            torch.cuda.synchronize(d)
        if i >= 3:
            times.append(time.perf_counter() - t0)
    tps = sorted(seq / t for t in times)
    out = {"seq": seq, "rank": rank, "targets": targets, "steps": steps, "shape": shape, "gpus": gpus,
           "train_tok_s": {"median": statistics.median(tps), "min": tps[0], "max": tps[-1]},
           "model_tflop_s": statistics.median(tps) / seq * step_flops(seq, shape) / 1e12,
           "peak_mib": [torch.cuda.max_memory_allocated(d) / 2**20 for d in range(gpus)], "loss_last": float(loss)}
    del model, opt
    torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="512,2048")
    ap.add_argument("--ranks", default="8,16")
    ap.add_argument("--targets", default="qv,all")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--liger", action="store_true", help="liger-kernel's Llama kernels applied first")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the card's dense bf16 TFLOP/s")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b", help="Llama-3.2-1B's or Llama-3.1-8B's shape")
    ap.add_argument("--gpus", type=int, default=1, help="the blocks split in equal runs over this many GPUs")
    a = ap.parse_args()
    if not 1 <= a.gpus <= torch.cuda.device_count():
        ap.error(f"--gpus {a.gpus}: this machine has {torch.cuda.device_count()} GPUs")
    if a.liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
        apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, cross_entropy=False,
                                    fused_linear_cross_entropy=True)
    runs = []
    for targets in a.targets.split(","):
        for rank in (int(r) for r in a.ranks.split(",")):
            for seq in (int(s) for s in a.seqs.split(",")):
                runs.append(run(seq, rank, targets, a.steps, a.shape, a.gpus))
                runs[-1]["mfu"] = runs[-1]["model_tflop_s"] / (a.peak_tflops * a.gpus)
                print(json.dumps(runs[-1]), flush=True)
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "liger": a.liger,
                      "peak_tflops": a.peak_tflops, "runs": runs}))


if __name__ == "__main__":
    main()
