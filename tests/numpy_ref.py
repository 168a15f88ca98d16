"""An independent float64 NumPy re-implementation of a llama GGUF, with LoRA.

This is the gradient oracle's reference: the forward pass, the masked
next-token cross-entropy and its exact backward pass, written from the maths
and from facts read in the pinned llama.cpp tree (no code copied):

- RMSNorm: x / sqrt(mean(x^2) + eps) * w.
- RoPE for LLM_ARCH_LLAMA is LLAMA_ROPE_TYPE_NORM: it rotates ADJACENT pairs
  (x[2i], x[2i+1]) by pos * base^(-2i/head_dim) (ggml-cpu rotate_pairs with
  n_offset 1; theta_scale = base^(-2/n_dims)). YaRN is off (ext_factor 0,
  freq_scale 1, attn_factor 1).
- GQA: query head h reads K/V head h // (n_head / n_head_kv) (ggml_mul_mat
  broadcasts dim 2 by integer division).
- Attention scale 1/sqrt(head_dim); SwiGLU FFN down(silu(gate x) * up x).
- LoRA (llm_graph_context::build_lora_mm): W x + scale * B (A x) with
  scale = alpha / rank, rank = B's inner dimension.
- Head tied to token_embd when the file has no output.weight.

Orientation: every matrix is held as ggml stores it, read row-major, so a
ggml tensor with ne = {n_in, n_out} is a NumPy (n_out, n_in) array and y = x @ W.T.
LoRA A has ggml ne {n_in, r} -> NumPy (r, n_in); B has ne {r, n_out} -> (n_out, r).

GGUF metadata is read by a small header parser here rather than
gguf.GGUFReader, whose field parsing took about 10 s per file on the project
machine for the 49152-entry tokenizer arrays; tensor bytes are dequantized
with gguf.quants.dequantize.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import numpy as np

TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")

# -- GGUF reading ---------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFContents:
    """Key/values as (value, value type, array element type or None), and tensor infos."""
    kv: dict[str, tuple[object, int, int | None]]
    tensors: dict[str, tuple[int, tuple[int, ...], int]]  # name -> (ggml type, ne, absolute offset)
    path: Path

    def value(self, key: str, default=None):
        return self.kv[key][0] if key in self.kv else default


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse a GGUF (v2/v3) header: all key/values and all tensor infos."""
    path = Path(path)
    buf = path.read_bytes()
    if buf[:4] != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    pos = 4
    (version,) = struct.unpack_from("<I", buf, pos)
    if version < 2:
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    n_tensors, n_kv = struct.unpack_from("<QQ", buf, pos + 4)
    pos += 20

    def read_str(p: int) -> tuple[str, int]:
        (n,) = struct.unpack_from("<Q", buf, p)
        return buf[p + 8:p + 8 + n].decode("utf-8"), p + 8 + n

    def read_value(t: int, p: int):
        if t == _STRING:
            return read_str(p)
        fmt = _SCALARS[t]
        return struct.unpack_from(fmt, buf, p)[0], p + struct.calcsize(fmt)

    kv: dict[str, tuple[object, int, int | None]] = {}
    for _ in range(n_kv):
        key, pos = read_str(pos)
        (t,) = struct.unpack_from("<I", buf, pos)
        pos += 4
        if t == _ARRAY:
            sub, n = struct.unpack_from("<IQ", buf, pos)
            pos += 12
            if sub == _STRING:
                items = []
                for _ in range(n):
                    s, pos = read_str(pos)
                    items.append(s)
                kv[key] = (items, t, sub)
            else:
                dt = np.dtype(_SCALARS[sub])
                kv[key] = (np.frombuffer(buf, dt, n, pos).tolist(), t, sub)
                pos += n * dt.itemsize
        else:
            v, pos = read_value(t, pos)
            kv[key] = (v, t, None)
    infos = []
    for _ in range(n_tensors):
        name, pos = read_str(pos)
        (nd,) = struct.unpack_from("<I", buf, pos)
        ne = struct.unpack_from(f"<{nd}Q", buf, pos + 4)
        gtype, off = struct.unpack_from("<IQ", buf, pos + 4 + 8 * nd)
        pos += 4 + 8 * nd + 12
        infos.append((name, gtype, tuple(ne), off))
    align = kv.get("general.alignment", (32,))[0]
    data_start = (pos + align - 1) // align * align
    tensors = {name: (gtype, ne, data_start + off) for name, gtype, ne, off in infos}
    return GGUFContents(kv, tensors, path)


def load_tensor(g: GGUFContents, name: str) -> np.ndarray:
    """A tensor as float64 in NumPy orientation (ggml ne reversed), dequantized if needed."""
    import gguf

    gtype, ne, off = g.tensors[name]
    qtype = gguf.GGMLQuantizationType(gtype)
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    n = int(np.prod(ne))
    nbytes = n // block * type_size
    with open(g.path, "rb") as f:
        f.seek(off)
        raw = np.frombuffer(f.read(nbytes), dtype=np.uint8)
    shape = tuple(reversed(ne))
    if qtype == gguf.GGMLQuantizationType.F32:
        arr = raw.view(np.float32).reshape(shape)
    else:
        rows = raw.reshape(shape[:-1] + (shape[-1] // block * type_size,))
        arr = gguf.quants.dequantize(rows, qtype).reshape(shape)
    return arr.astype(np.float64)


# -- the model ----------------------------------------------------------------


@dataclass
class LlamaRef:
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int
    rope_base: float
    eps: float
    tok_embd: np.ndarray                 # (n_vocab, n_embd)
    output: np.ndarray                   # (n_vocab, n_embd), tok_embd if tied
    output_norm: np.ndarray
    layers: list[dict[str, np.ndarray]]  # attn_norm, ffn_norm and TARGETS
    weight_types: dict[tuple[int, str], int] = field(default_factory=dict)  # ggml type of each block matrix

    @classmethod
    def from_gguf(cls, path: str | Path) -> LlamaRef:
        g = read_gguf(path)
        arch = g.value("general.architecture")
        if arch != "llama":
            raise ValueError(f"{path}: architecture {arch!r}, the reference implements llama only")
        n_layer = g.value("llama.block_count")
        n_embd = g.value("llama.embedding_length")
        n_head = g.value("llama.attention.head_count")
        head_dim = n_embd // n_head
        if g.value("llama.rope.dimension_count", head_dim) != head_dim:
            raise ValueError("partial RoPE is not implemented in the reference")
        if g.value("llama.rope.scaling.type") not in (None, "none"):
            raise ValueError("RoPE scaling is not implemented in the reference")
        emb = load_tensor(g, "token_embd.weight")
        out = load_tensor(g, "output.weight") if "output.weight" in g.tensors else emb
        layers = []
        for il in range(n_layer):
            layers.append({k: load_tensor(g, f"blk.{il}.{k}.weight")
                           for k in ("attn_norm", "ffn_norm") + TARGETS})
        types = {(il, t): g.tensors[f"blk.{il}.{t}.weight"][0] for il in range(n_layer) for t in TARGETS}
        return cls(n_layer=n_layer, n_head=n_head,
                   n_head_kv=g.value("llama.attention.head_count_kv", n_head), head_dim=head_dim,
                   rope_base=float(g.value("llama.rope.freq_base", 10000.0)),
                   eps=float(g.value("llama.attention.layer_norm_rms_epsilon")),
                   tok_embd=emb, output=out, output_norm=load_tensor(g, "output_norm.weight"),
                   layers=layers, weight_types=types)

    @cached_property
    def output_t(self) -> np.ndarray:
        """The head transposed, contiguous (n_embd, n_vocab).

        Both head products then reduce over a contiguous axis. With the
        (n_vocab, n_embd) layout, dL/dlogits @ output reduces over 49152 rows
        and OpenBLAS took 0.4 s for it on the shared 2-core machine, 20x this.
        """
        return np.ascontiguousarray(self.output.T)

    def target_shape(self, il: int, target: str) -> tuple[int, int]:
        """(n_out, n_in) of a block matrix."""
        return self.layers[il][target].shape


@dataclass
class Lora:
    """LoRA factors keyed by (layer, target): A (r, n_in), B (n_out, r); y += scale * B (A x)."""
    scale: float
    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @classmethod
    def random(cls, model: LlamaRef, targets, rank: int, alpha: float, layers=None,
               seed: int = 0, b_std: float = 0.0) -> Lora:
        """A uniform in +-1/sqrt(n_in) (as trainers initialize it); B ~ N(0, b_std) (0: zeros)."""
        rng = np.random.default_rng(seed)
        out = cls(scale=alpha / rank)
        for il in (range(model.n_layer) if layers is None else layers):
            for t in targets:
                n_out, n_in = model.target_shape(il, t)
                a = rng.uniform(-1, 1, (rank, n_in)) / np.sqrt(n_in)
                b = rng.standard_normal((n_out, rank)) * b_std
                out.factors[(il, t)] = (a, b)
        return out

    def keys(self):
        return list(self.factors)

    def flat(self, order) -> np.ndarray:
        """Concatenate tensors named by `order`: a list of ((layer, target), "a" | "b")."""
        return np.concatenate([self.factors[k][0 if ab == "a" else 1].ravel() for k, ab in order])

    def with_flat(self, order, vec: np.ndarray) -> Lora:
        out = Lora(self.scale, dict(self.factors))
        i = 0
        for k, ab in order:
            a, b = out.factors[k]
            ref = a if ab == "a" else b
            piece = np.asarray(vec[i:i + ref.size], dtype=np.float64).reshape(ref.shape)
            i += ref.size
            out.factors[k] = (piece, b) if ab == "a" else (a, piece)
        if i != len(vec):
            raise ValueError(f"flat vector has {len(vec)} values, the layout takes {i}")
        return out


def _rms(x, w, eps):
    inv = 1.0 / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return x * inv * w, inv


def _rms_back(dy, x, w, inv):
    g = dy * w
    return inv * (g - x * inv * inv * np.mean(g * x, axis=-1, keepdims=True))


def _rope_tables(n_pos: int, head_dim: int, base: float, pos0: int = 0):
    # theta_i = pos * base^(-2i/head_dim) for pair i = (2i, 2i+1)
    inv_freq = base ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(pos0, pos0 + n_pos, dtype=np.float64)[:, None] * inv_freq[None, :]
    return np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]   # (T, 1, head_dim/2)


def _rope(x, cos, sin, sign=1.0):
    """Rotate adjacent pairs of x (T, H, head_dim); sign -1 applies the inverse rotation."""
    x0, x1 = x[..., 0::2], x[..., 1::2]
    s = sign * sin
    out = np.empty_like(x)
    out[..., 0::2] = x0 * cos - x1 * s
    out[..., 1::2] = x0 * s + x1 * cos
    return out


GGML_TYPE_Q8_0 = 8


def q8_0_roundtrip(x: np.ndarray) -> np.ndarray:
    """x (rows of a multiple of 32) quantized to Q8_0 and back, as ggml-cpu
    quantizes a matmul's activations for a Q8_0 weight (vec_dot_type Q8_0):
    d = amax/127 stored as fp16, q = roundf(x / d) (half away from zero)."""
    x32 = x.astype(np.float32)
    blocks = x32.reshape(-1, 32)
    d = np.abs(blocks).max(axis=1, keepdims=True) / np.float32(127)
    inv = np.divide(np.float32(1), d, out=np.zeros_like(d), where=d != 0)
    scaled = blocks * inv
    q = np.trunc(scaled + np.copysign(np.float32(0.5), scaled))
    return (q * d.astype(np.float16).astype(np.float32)).reshape(x.shape).astype(np.float64)


def _silu(x):
    return x / (1.0 + np.exp(-x))


class Forward:
    """One forward pass, keeping what backward needs."""

    def __init__(self, model: LlamaRef, tokens, lora: Lora | None = None, act_quant: bool = False):
        """act_quant: round the input of every Q8_0 block matmul through Q8_0,
        emulating llama.cpp's CPU matmul (backward treats it as identity)."""
        self.model, self.lora, self.act_quant = model, lora, act_quant
        m = model
        tokens = np.asarray(tokens)
        self.tokens = tokens
        T = len(tokens)
        H, Hkv, hd = m.n_head, m.n_head_kv, m.head_dim
        self.cos, self.sin = _rope_tables(T, hd, m.rope_base)
        self.causal = np.tril(np.ones((T, T), dtype=bool))
        self.scale = 1.0 / np.sqrt(hd)
        self.cache = []
        h = m.tok_embd[tokens]
        for il, L in enumerate(m.layers):
            c = {"h_in": h}
            a, c["inv1"] = _rms(h, L["attn_norm"], m.eps)
            c["a"] = a
            q = self._lin(il, "attn_q", a, c).reshape(T, H, hd)
            k = self._lin(il, "attn_k", a, c).reshape(T, Hkv, hd)
            v = self._lin(il, "attn_v", a, c).reshape(T, Hkv, hd)
            q, k = _rope(q, self.cos, self.sin), _rope(k, self.cos, self.sin)
            kk = np.repeat(k, H // Hkv, axis=1)          # (T, H, hd) head h -> kv head h // group
            vv = np.repeat(v, H // Hkv, axis=1)
            s = np.einsum("thd,uhd->htu", q, kk) * self.scale
            s = np.where(self.causal[None], s, -np.inf)
            s -= s.max(axis=-1, keepdims=True)
            p = np.exp(s)
            p /= p.sum(axis=-1, keepdims=True)
            o = np.einsum("htu,uhd->thd", p, vv).reshape(T, H * hd)
            c.update(q=q, kk=kk, vv=vv, p=p, o=o)
            h = h + self._lin(il, "attn_output", o, c)
            c["h_mid"] = h
            f, c["inv2"] = _rms(h, L["ffn_norm"], m.eps)
            c["f"] = f
            g = self._lin(il, "ffn_gate", f, c)
            u = self._lin(il, "ffn_up", f, c)
            act = _silu(g) * u
            c.update(g=g, u=u, act=act)
            h = h + self._lin(il, "ffn_down", act, c)
            self.cache.append(c)
        self.h_out = h
        self.z, self.inv_out = _rms(h, m.output_norm, m.eps)
        self._logits = None

    @property
    def logits(self) -> np.ndarray:
        """(T, n_vocab) logits at every position (computed on first use: the head dominates the cost)."""
        if self._logits is None:
            self._logits = self.z @ self.model.output_t
        return self._logits

    def _lin(self, il, target, x, c):
        base_in = x
        if self.act_quant and self.model.weight_types.get((il, target)) == GGML_TYPE_Q8_0:
            base_in = q8_0_roundtrip(x)
        y = base_in @ self.model.layers[il][target].T
        if self.lora and (il, target) in self.lora.factors:
            a, b = self.lora.factors[(il, target)]
            xa = x @ a.T
            c[target + ".x"], c[target + ".xa"] = x, xa
            y = y + self.lora.scale * (xa @ b.T)
        return y

    def _lin_back(self, il, target, dy, c, grads):
        dx = dy @ self.model.layers[il][target]
        if self.lora and (il, target) in self.lora.factors:
            a, b = self.lora.factors[(il, target)]
            s = self.lora.scale
            dyb = dy @ b                                        # (T, r)
            grads[(il, target)] = (s * dyb.T @ c[target + ".x"], s * dy.T @ c[target + ".xa"])
            dx = dx + s * dyb @ a
        return dx

    # -- loss ----------------------------------------------------------------
    def loss_and_dz(self, loss_positions, targets=None):
        """Mean next-token cross-entropy over `loss_positions` and its gradient
        w.r.t. z, the final-normed hidden states (T, n_embd).

        loss_positions: bool (T,); position t's logits predict token t+1, so
        the last position must be False. The mean is over the True positions.
        targets: optional (loss positions, n_vocab) probability rows, in order:
        the cross-entropy against each row instead of the next token's one-hot;
        a row summing below 1 leaves the rest on the tokens it gives 0, as one
        outcome (dream_window_soft_targets).
        """
        lp = np.asarray(loss_positions, dtype=bool)
        T = len(self.tokens)
        if lp.shape != (T,) or lp[-1]:
            raise ValueError("loss_positions must be bool (T,) with the last position False")
        n = int(lp.sum())
        if n == 0:
            raise ValueError("no loss positions")
        idx = np.nonzero(lp)[0]
        tgt = self.tokens[idx + 1]
        # only the loss positions' logits: the head is most of a forward's cost
        x = self._logits[idx] if self._logits is not None else self.z[idx] @ self.model.output_t
        mx = x.max(axis=-1, keepdims=True)
        e = np.exp(x - mx)
        z = e.sum(axis=-1, keepdims=True)
        lse = (np.log(z) + mx)[:, 0]
        if targets is None:
            loss = float(np.mean(lse - x[np.arange(n), tgt]))
            d = e / z
            d[np.arange(n), tgt] -= 1.0
        else:
            q = np.asarray(targets, dtype=np.float64)
            if q.shape != x.shape:
                raise ValueError(f"targets {q.shape} must be (loss positions, n_vocab) = {x.shape}")
            # -sum_v q_v log softmax(x)_v, whose gradient is softmax(x) - q for rows summing to 1;
            # a row summing to s < 1 leaves rest = 1 - s on the tokens it sets to 0, as one outcome:
            # - rest log(sum of softmax(x) over those tokens)
            p = e / z
            loss_rows = q.sum(axis=-1) * lse - (q * x).sum(axis=-1)
            d = p * q.sum(axis=-1, keepdims=True) - q
            rest = np.clip(1.0 - q.sum(axis=-1), 0.0, None)
            tail = q <= 0
            q_rest = (p * tail).sum(axis=-1)
            has = rest > 0
            loss_rows[has] -= rest[has] * np.log(q_rest[has])
            # d/dx of -rest log Q_rest: rest (p - tail p / Q_rest)
            d[has] += rest[has, None] * (p[has] - tail[has] * p[has] / q_rest[has, None])
            loss = float(np.mean(loss_rows))
        dz = np.zeros_like(self.z)
        dz[idx] = (self.model.output_t @ (d / n).T).T
        return loss, dz

    def backward(self, dz, kv_constant_before: int = 0,
                 kv_edges=None) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
        """LoRA gradients (dA, dB) for every adapted (layer, target), given dL/dz.

        kv_constant_before: K/V at positions < this are treated as constants
        (no gradient flows into them), as the plain chunked walk reads its
        cached prefix. Positions before it then receive no gradient at all:
        their only path to later positions is attention's K/V.

        kv_edges: optional bool (T, T); where kv_edges[t, u] is False, query t
        reads K/V of position u as a constant (the edge is detached, in every
        layer); the query side keeps its gradient. The exact walk's horizon.
        """
        m = self.model
        T = len(self.tokens)
        H, Hkv, hd = m.n_head, m.n_head_kv, m.head_dim
        grads: dict = {}
        dh = _rms_back(dz, self.h_out, m.output_norm, self.inv_out)
        for il in reversed(range(m.n_layer)):
            c, L = self.cache[il], m.layers[il]
            # FFN branch: h_out = h_mid + down(silu(g) * u)
            dact = self._lin_back(il, "ffn_down", dh, c, grads)
            g, u = c["g"], c["u"]
            sig = 1.0 / (1.0 + np.exp(-g))
            du = dact * g * sig
            dg = dact * u * sig * (1.0 + g * (1.0 - sig))
            df = self._lin_back(il, "ffn_gate", dg, c, grads) + self._lin_back(il, "ffn_up", du, c, grads)
            dh = dh + _rms_back(df, c["h_mid"], L["ffn_norm"], c["inv2"])
            # attention branch: h_mid = h_in + wo(attn(q, k, v))
            do = self._lin_back(il, "attn_output", dh, c, grads).reshape(T, H, hd)
            p = c["p"]
            dp = np.einsum("thd,uhd->htu", do, c["vv"])
            edges = np.ones((T, T)) if kv_edges is None else np.asarray(kv_edges, dtype=np.float64)
            dvv = np.einsum("htu,thd->uhd", p * edges[None], do)
            ds = p * (dp - np.sum(dp * p, axis=-1, keepdims=True)) * self.scale
            dq = np.einsum("htu,uhd->thd", ds, c["kk"])
            dkk = np.einsum("htu,thd->uhd", ds * edges[None], c["q"])
            group = H // Hkv
            dk = dkk.reshape(T, Hkv, group, hd).sum(axis=2)
            dv = dvv.reshape(T, Hkv, group, hd).sum(axis=2)
            dk[:kv_constant_before] = 0.0
            dv[:kv_constant_before] = 0.0
            dq = _rope(dq, self.cos, self.sin, sign=-1.0).reshape(T, H * hd)
            dk = _rope(dk, self.cos, self.sin, sign=-1.0).reshape(T, Hkv * hd)
            da = (self._lin_back(il, "attn_q", dq, c, grads)
                  + self._lin_back(il, "attn_k", dk, c, grads)
                  + self._lin_back(il, "attn_v", dv.reshape(T, Hkv * hd), c, grads))
            dh = dh + _rms_back(da, c["h_in"], L["attn_norm"], c["inv1"])
        return grads


def positions_from_mask(loss_mask) -> np.ndarray:
    """Convert a per-token mask (mask[i]: train the prediction OF token i, the
    dream.h convention; mask[0] is ignored) into loss positions (position t's
    logits predict token t+1)."""
    m = np.asarray(loss_mask).astype(bool)
    return np.append(m[1:], False)


def plain_walk_grad(model: LlamaRef, tokens, loss_positions, lora: Lora, chunk: int, targets=None):
    """Loss and gradient of the plain chunked walk over one window.

    Each chunk contributes (its loss tokens / window loss tokens) of the
    window's mean loss; its backward treats the K/V of earlier chunks as
    constants. The forward (and so the loss) equals the unchunked one.
    `targets`: soft target rows, as Forward.loss_and_dz takes them.
    """
    lp = np.asarray(loss_positions, dtype=bool)
    fw = Forward(model, tokens, lora)
    value, dz = fw.loss_and_dz(lp, targets)
    total: dict = {}
    for start in range(0, len(lp), chunk):
        part = np.zeros_like(dz)
        part[start:start + chunk] = dz[start:start + chunk]
        if not part.any():
            continue
        for k, (da, db) in fw.backward(part, kv_constant_before=start).items():
            if k in total:
                total[k] = (total[k][0] + da, total[k][1] + db)
            else:
                total[k] = (da, db)
    return value, total


def horizon_edges(n_tokens: int, chunk: int, horizon: int) -> np.ndarray:
    """The exact walk's horizon as attention edges: query t (in the chunk that
    starts at (t // chunk) * chunk) reads K/V of positions older than
    horizon before its chunk's start as constants. horizon <= 0: every edge
    carries gradient (the whole-window gradient)."""
    t = np.arange(n_tokens)
    start = (t // chunk) * chunk
    if horizon <= 0:
        return np.ones((n_tokens, n_tokens), dtype=bool)
    return t[None, :] >= (start - horizon)[:, None]


def horizon_walk_grad(model: LlamaRef, tokens, loss_positions, lora: Lora, chunk: int, horizon: int):
    """Loss and gradient of the whole window with the edges older than the
    horizon detached (horizon_edges); horizon <= 0 is the one-chunk gradient."""
    fw = Forward(model, tokens, lora)
    value, dz = fw.loss_and_dz(np.asarray(loss_positions, dtype=bool))
    return value, fw.backward(dz, kv_edges=horizon_edges(len(fw.tokens), chunk, horizon))


def loss(model: LlamaRef, tokens, loss_positions, lora: Lora | None = None) -> float:
    return Forward(model, tokens, lora).loss_and_dz(loss_positions)[0]


def loss_and_grad(model: LlamaRef, tokens, loss_positions, lora: Lora, targets=None):
    fw = Forward(model, tokens, lora)
    value, dz = fw.loss_and_dz(loss_positions, targets)
    return value, fw.backward(dz)


def central_differences(model: LlamaRef, tokens, loss_positions, lora: Lora, order, h: float) -> np.ndarray:
    """(L(theta + h e_i) - L(theta - h e_i)) / 2h for every entry i of the flat LoRA vector."""
    theta = lora.flat(order)
    fd = np.empty_like(theta)
    for i in range(theta.size):
        e = np.zeros_like(theta)
        e[i] = h
        fd[i] = (loss(model, tokens, loss_positions, lora.with_flat(order, theta + e))
                 - loss(model, tokens, loss_positions, lora.with_flat(order, theta - e))) / (2 * h)
    return fd


def flat_grad(grads, order) -> np.ndarray:
    return np.concatenate([grads[k][0 if ab == "a" else 1].ravel() for k, ab in order])


def adamw_step(theta, grad, m, v, t, *, lr, beta1, beta2, eps, wd, clip=0.0):
    """One AdamW step (decoupled decay, bias-corrected moments), as ggml-opt
    defines it, after optional clipping of the gradient's global L2 norm.

    Returns (theta', m', v'). t is the 1-based step index.
    """
    norm = float(np.linalg.norm(grad))
    if clip > 0 and norm > clip:
        grad = grad * (clip / norm)
    m = beta1 * m + (1 - beta1) * grad
    v = beta2 * v + (1 - beta2) * grad * grad
    mh = m / (1 - beta1 ** t)
    vh = v / (1 - beta2 ** t)
    theta = theta * (1 - lr * wd) - lr * mh / (np.sqrt(vh) + eps)
    return theta, m, v
