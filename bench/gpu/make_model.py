#!/usr/bin/env python3
"""Write a random-weight llama GGUF of Llama-3.2-1B shapes for the GPU benchmark.

Generated on the device machine, so no model file travels: 2048 wide, 16 blocks,
32 query / 8 K/V heads (head 64), FFN 8192, with SmolLM2's 49,152-token
vocabulary. The tokenizer.* metadata comes from a JSON dump of the default
model's fields (make it here with --dump-tokenizer; it is about 1.6 MB), since
llama.cpp needs a vocabulary to load a model even when the benchmark feeds token
ids directly. Weights follow tests/tiny_model.py's scaling (std 1/sqrt(n_in),
Q/K gain 2; norms near 1; the head tied to the embeddings).

quant: q8_0 (default; every 2-D matrix, the embeddings included, as a Q8_0
conversion would store them), q4_0, f16 or f32. --shape llama-8b writes Llama-3.1-8B's blocks
(4096 wide, 32 blocks, 32/8 heads, FFN 14336; the same vocabulary, tied). --shape small writes a
256-wide, 2-block model (rows a multiple of 256, so K-quants apply) for the
GPU check's Q4_K case. The `gguf` package quantizes only
the legacy block types (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0) in NumPy; there is no K-quant
(Q4_K_M) quantizer in it, so the anchors' Q4_K_M row needs llama-quantize.

  make_model.py --dump-tokenizer .gpu/tokenizer_kv.json        (here, once)
  make_model.py --tokenizer .gpu/tokenizer_kv.json --out m.gguf [--quant q8_0]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
from tiny_model import ARCH, TinyShape, _layer_matrices  # noqa: E402

LLAMA_1B = TinyShape(n_embd=2048, n_layer=16, n_head=32, n_head_kv=8, n_ff=8192, n_ctx=8192,
                     rope_freq_base=500000.0)
LLAMA_8B = TinyShape(n_embd=4096, n_layer=32, n_head=32, n_head_kv=8, n_ff=14336, n_ctx=8192,
                     rope_freq_base=500000.0)
SMALL = TinyShape(n_embd=256, n_layer=2, n_head=4, n_head_kv=2, n_ff=512, n_ctx=512)


def dump_tokenizer(out: Path) -> None:
    sys.path.insert(0, str(ROOT))
    from tiny_model import _tokenizer_fields

    from dreamstage.default_model import default_model

    rows = []
    for key, value, vtype, sub in _tokenizer_fields(default_model()):
        rows.append([key, value.tolist() if hasattr(value, "tolist") else value,
                     int(vtype), None if sub is None else int(sub)])
    out.write_text(json.dumps(rows))


def write_model(out: Path, tokenizer: Path, quant: str, seed: int, shape: TinyShape) -> Path:
    import gguf

    qtypes = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}
    ftypes = {"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
              "f16": gguf.LlamaFileType.MOSTLY_F16, "f32": gguf.LlamaFileType.ALL_F32}
    if quant not in ftypes:
        raise SystemExit(f"quant {quant!r} is not one of {sorted(ftypes)}")
    fields = json.loads(tokenizer.read_text())
    n_vocab = next(len(v) for k, v, *_ in fields if k == "tokenizer.ggml.tokens")
    rng = np.random.default_rng(seed)
    d = shape.n_embd
    w = gguf.GGUFWriter(str(out), ARCH)
    w.add_name(f"dreamstage bench model {d}x{shape.n_layer} random")
    w.add_block_count(shape.n_layer)
    w.add_context_length(shape.n_ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(shape.n_ff)
    w.add_head_count(shape.n_head)
    w.add_head_count_kv(shape.n_head_kv)
    w.add_rope_freq_base(shape.rope_freq_base)
    w.add_rope_dimension_count(shape.head_dim)
    w.add_layer_norm_rms_eps(shape.rms_eps)
    w.add_vocab_size(n_vocab)
    w.add_file_type(ftypes[quant])
    for key, value, vtype, sub in fields:
        w.add_key_value(key, value, gguf.GGUFValueType(vtype),
                        sub_type=None if sub is None else gguf.GGUFValueType(sub))

    def add(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if arr.ndim == 2 and quant in qtypes:
            w.add_tensor(name, gguf.quants.quantize(arr, qtypes[quant]), raw_dtype=qtypes[quant])
        elif arr.ndim == 2 and quant == "f16":
            w.add_tensor(name, arr.astype(np.float16))
        else:
            w.add_tensor(name, arr)

    def normal(n_out: int, n_in: int, std: float) -> np.ndarray:
        return rng.standard_normal((n_out, n_in), dtype=np.float32) * np.float32(std)

    # std 2.4/sqrt(d): tied-head logits spread over a few units, as in the tiny model
    add("token_embd.weight", normal(n_vocab, d, 2.4 / np.sqrt(d)))
    add("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(d))
    for il in range(shape.n_layer):
        add(f"blk.{il}.attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(d))
        add(f"blk.{il}.ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(d))
        for target, (n_out, n_in) in _layer_matrices(shape).items():
            gain = 2.0 if target in ("attn_q", "attn_k") else 1.0
            add(f"blk.{il}.{target}.weight", normal(n_out, n_in, gain / np.sqrt(n_in)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dump-tokenizer", type=Path, help="write the default model's tokenizer.* fields as JSON and exit")
    ap.add_argument("--tokenizer", type=Path, help="the JSON written by --dump-tokenizer")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quant", default="q8_0")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--layers", type=int, default=None, help="fewer blocks for a quick try")
    ap.add_argument("--shape", choices=("llama-1b", "llama-8b", "small"), default="llama-1b")
    a = ap.parse_args()
    if a.dump_tokenizer:
        dump_tokenizer(a.dump_tokenizer)
        return 0
    if not (a.tokenizer and a.out):
        ap.error("--tokenizer and --out are required")
    base = {"small": SMALL, "llama-8b": LLAMA_8B}.get(a.shape, LLAMA_1B)
    shape = TinyShape(**{**base.__dict__, "n_layer": a.layers or base.n_layer})
    t0 = time.time()
    write_model(a.out, a.tokenizer, a.quant, a.seed, shape)
    print(f"[make_model] {a.out}: {a.out.stat().st_size / 2**20:.0f} MiB, {a.quant}, {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
