"""PEFT LoRA files (adapter_model.safetensors + adapter_config.json) to and from our factors.

PEFT names a pair `base_model.model.model.layers.<i>.<module>.lora_A.weight`
(shape (rank, n_in)) and `...lora_B.weight` ((n_out, rank)), with
`lora_alpha` and `r` in the config; llama.cpp's GGUF LoRA holds the same
matrices as `blk.<i>.<target>.weight.lora_a|b` with `adapter.lora.alpha`,
and scales by alpha / rank as PEFT does. For the llama architecture the
GGUF conversion reorders the rows of the q and k projections (the rotary
halves interleaved per head), so B of attn_q / attn_k is reordered on the
way in and back on the way out. Safetensors is read and written here with
numpy (an 8-byte header length, a JSON header, the raw tensors).
"""
from __future__ import annotations

import json
import re
import struct

import numpy as np

from dreamstage.adapters.files import Factors

# PEFT's module names (Hugging Face llama-style models) -> llama.cpp's tensor names.
HF_TO_GGUF = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
GGUF_TO_HF = {v: k for k, v in HF_TO_GGUF.items()}
_PEFT_NAME = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(?:self_attn|mlp)\.([a-z_]+)\.lora_([AB])"
                        r"(?:\.default)?\.weight$")
_DTYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64}
_BF16 = "BF16"


class PeftError(ValueError):
    """A PEFT adapter that cannot be converted; the message names the file and the entry."""


def read_safetensors(data: bytes) -> dict[str, np.ndarray]:
    if len(data) < 8:
        raise PeftError("adapter_model.safetensors: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", data[:8])
    if n > len(data) - 8:
        raise PeftError("adapter_model.safetensors: its header runs past the end of the file")
    try:
        header = json.loads(data[8:8 + n])
    except ValueError as e:
        raise PeftError(f"adapter_model.safetensors: its header is not JSON ({e})") from None
    body = memoryview(data)[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (a, b) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise PeftError(f"adapter_model.safetensors: tensor {name!r} has no dtype/shape/data_offsets") from None
        if not 0 <= a <= b <= len(body):
            raise PeftError(f"adapter_model.safetensors: tensor {name!r} lies outside the file")
        raw = bytes(body[a:b])
        if dtype == _BF16:
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif dtype in _DTYPES:
            arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[dtype]).newbyteorder("<"))
        else:
            raise PeftError(f"adapter_model.safetensors: tensor {name!r} is {dtype}; expected F32, F16 or BF16")
        if arr.size != int(np.prod(shape)):
            raise PeftError(f"adapter_model.safetensors: tensor {name!r} holds {arr.size} values, not {shape}")
        out[name] = arr.astype(np.float32).reshape(shape)
    return out


def write_safetensors(tensors: dict[str, np.ndarray]) -> bytes:
    header, blobs, at = {}, [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(blobs)


def _rope_rows(b: np.ndarray, n_head: int, inverse: bool) -> np.ndarray:
    """llama's q/k row order: HF -> GGUF (or back, `inverse`), per head."""
    rows = b.shape[0]
    if rows % (2 * n_head):
        raise PeftError(f"a q/k projection of {rows} rows does not split into {n_head} heads")
    half = rows // n_head // 2
    if inverse:
        return b.reshape(n_head, half, 2, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)
    return b.reshape(n_head, 2, half, *b.shape[1:]).swapaxes(1, 2).reshape(b.shape)


def peft_to_factors(config: dict, tensors: dict[str, np.ndarray], arch: str, n_head: int,
                    n_head_kv: int) -> tuple[Factors, float]:
    """A PEFT adapter as ({(layer, target): (A, B)}, alpha) for `arch`; PeftError naming what does not convert."""
    if config.get("peft_type", "LORA") != "LORA":
        raise PeftError(f"adapter_config.json: peft_type {config.get('peft_type')!r}; only LORA converts")
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise PeftError("adapter_config.json: needs r (a positive integer) and lora_alpha (positive)")
    if config.get("use_dora") or config.get("use_rslora"):
        raise PeftError("adapter_config.json: DoRA and rsLoRA adapters do not convert to llama.cpp's LoRA")
    parts: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    for name, t in tensors.items():
        m = _PEFT_NAME.match(name)
        if m is None or m.group(2) not in HF_TO_GGUF:
            raise PeftError(f"adapter_model.safetensors: tensor {name!r} is not a LoRA factor of "
                            f"{', '.join(HF_TO_GGUF)} in model.layers.N")
        if t.ndim != 2:
            raise PeftError(f"adapter_model.safetensors: tensor {name!r} has shape {t.shape}, not a matrix")
        parts.setdefault((int(m.group(1)), HF_TO_GGUF[m.group(2)]), {})[m.group(3)] = t
    if not parts:
        raise PeftError("adapter_model.safetensors: no LoRA factors")
    out: Factors = {}
    for (layer, target), ab in parts.items():
        if set(ab) != {"A", "B"}:
            raise PeftError(f"adapter_model.safetensors: layer {layer} {GGUF_TO_HF[target]} lacks lora_"
                            f"{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise PeftError(f"adapter_model.safetensors: layer {layer} {GGUF_TO_HF[target]}: A {a.shape} and "
                            f"B {b.shape} do not have rank r={rank}")
        if arch == "llama" and target in ("attn_q", "attn_k"):
            b = _rope_rows(b, n_head if target == "attn_q" else n_head_kv, inverse=False)
        out[(layer, target)] = (a, b)
    return out, float(alpha)


def factors_to_peft(factors: Factors, alpha: float, arch: str, n_head: int, n_head_kv: int,
                    base_model: str) -> tuple[dict, bytes]:
    """Our factors as PEFT's (adapter_config.json as a dict, adapter_model.safetensors bytes)."""
    ranks = {a.shape[0] for a, _ in factors.values()}
    if len(ranks) != 1:
        raise PeftError(f"the adapter mixes ranks {sorted(ranks)}; PEFT's config has one r")
    tensors = {}
    for (layer, target), (a, b) in factors.items():
        if target not in GGUF_TO_HF:
            raise PeftError(f"target {target} has no PEFT module name")
        if arch == "llama" and target in ("attn_q", "attn_k"):
            b = _rope_rows(b, n_head if target == "attn_q" else n_head_kv, inverse=True)
        kind = "self_attn" if target.startswith("attn") else "mlp"
        stem = f"base_model.model.model.layers.{layer}.{kind}.{GGUF_TO_HF[target]}"
        tensors[f"{stem}.lora_A.weight"] = a
        tensors[f"{stem}.lora_B.weight"] = b
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": ranks.pop(), "lora_alpha": alpha,
              "lora_dropout": 0.0, "bias": "none", "base_model_name_or_path": base_model,
              "target_modules": sorted({GGUF_TO_HF[t] for _, t in factors})}
    return config, write_safetensors(tensors)
