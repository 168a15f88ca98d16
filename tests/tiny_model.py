"""A tiny llama-architecture GGUF for fast tests, generated on the fly.

The tiny model borrows the default model's tokenizer metadata verbatim
(tokens, merges, token types, special ids, chat template), so it tokenizes
exactly like SmolLM2 while its transformer is small enough for a float64 NumPy
re-implementation (tests/numpy_ref.py) to run many forwards per second.

Weights are seeded random. Their scale keeps every activation O(1): block
matrices are Gaussian with std 1/sqrt(n_in), so logits spread over a few units
rather than collapsing to a uniform (or one-hot) distribution, which would
make gradient checks vacuous.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

ARCH = "llama"


@dataclass(frozen=True)
class TinyShape:
    n_embd: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_head_kv: int = 2          # GQA: two query heads share each K/V head
    n_ff: int = 128
    n_ctx: int = 256
    rope_freq_base: float = 10000.0
    rms_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head


DEFAULT_SHAPE = TinyShape()   # write_tiny_model's default (frozen, so one shared instance is safe)


def _tokenizer_fields(default_path: Path) -> list[tuple[str, object, object, object]]:
    """(key, value, value type, array element type) of every tokenizer.* field."""
    import gguf

    # numpy_ref's header parser, not gguf.GGUFReader: the reader spends about
    # 10 s here building per-string memmap views of the 98k tokenizer entries.
    from numpy_ref import read_gguf

    out = []
    for key, (value, vtype, sub) in read_gguf(default_path).kv.items():
        if key.startswith("tokenizer."):
            out.append((key, value, gguf.GGUFValueType(vtype),
                        None if sub is None else gguf.GGUFValueType(sub)))
    return out


def _layer_matrices(shape: TinyShape) -> dict[str, tuple[int, int]]:
    """Per-block matrix (n_out, n_in) in NumPy row-major orientation (ggml ne reversed)."""
    d, hd = shape.n_embd, shape.head_dim
    return {
        "attn_q": (shape.n_head * hd, d),
        "attn_k": (shape.n_head_kv * hd, d),
        "attn_v": (shape.n_head_kv * hd, d),
        "attn_output": (d, shape.n_head * hd),
        "ffn_gate": (shape.n_ff, d),
        "ffn_up": (shape.n_ff, d),
        "ffn_down": (d, shape.n_ff),
    }


def write_tiny_model(directory: Path, *, quant: str = "f32", seed: int = 1234,
                     shape: TinyShape = DEFAULT_SHAPE, default_path: Path | None = None) -> Path:
    """Write a tiny llama GGUF into `directory` and return its path.

    quant: "f32" (every tensor F32) or "q8_0" (the 2-D block matrices Q8_0;
    embeddings and norms stay F32, as llama.cpp conversions usually keep norms).
    """
    import gguf

    from dreamstage.default_model import default_model

    if quant not in ("f32", "q8_0"):
        raise ValueError(f"quant {quant!r} is not one of f32, q8_0")
    default_path = Path(default_path) if default_path else default_model()
    tok_fields = _tokenizer_fields(default_path)
    n_vocab = next(len(v) for k, v, *_ in tok_fields if k == "tokenizer.ggml.tokens")

    rng = np.random.default_rng(seed)
    d = shape.n_embd
    path = Path(directory) / f"tiny-llama-{quant}-s{seed}.gguf"
    w = gguf.GGUFWriter(str(path), ARCH)
    w.add_name("dreamstage tiny test model")
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
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant == "f32" else gguf.LlamaFileType.MOSTLY_Q8_0)
    for key, value, vtype, sub in tok_fields:
        w.add_key_value(key, value, vtype, sub_type=sub)

    def add_matrix(name: str, arr: np.ndarray) -> None:
        arr = np.ascontiguousarray(arr, dtype=np.float32)
        if quant == "q8_0" and arr.ndim == 2 and name.startswith("blk."):
            q = gguf.quants.quantize(arr, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, arr)

    # No output.weight: the head is tied to the embeddings (as in SmolLM2).
    # The final norm gives z with unit RMS entries, so logits z . e_v have a
    # std of about 0.3 * sqrt(n_embd) = 2.4: peaked but far from one-hot.
    emb = 0.3 * rng.standard_normal((n_vocab, d))
    add_matrix("token_embd.weight", emb)
    add_matrix("output_norm.weight", 1.0 + 0.1 * rng.standard_normal(d))
    for il in range(shape.n_layer):
        add_matrix(f"blk.{il}.attn_norm.weight", 1.0 + 0.1 * rng.standard_normal(d))
        add_matrix(f"blk.{il}.ffn_norm.weight", 1.0 + 0.1 * rng.standard_normal(d))
        for target, (n_out, n_in) in _layer_matrices(shape).items():
            # std 1/sqrt(n_in) keeps each projection's output at the input's
            # scale; Q/K get a little more so attention is not uniform.
            gain = 2.0 if target in ("attn_q", "attn_k") else 1.0
            add_matrix(f"blk.{il}.{target}.weight", gain * rng.standard_normal((n_out, n_in)) / np.sqrt(n_in))

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
