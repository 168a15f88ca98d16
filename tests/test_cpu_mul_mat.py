"""The batched CPU kernel for MUL_MAT through a Q4_1 weight
(dreamstage/ggml_ext/cpu/mul-mat-q4-1.cpp) against ggml's own Q4_1 x Q8_1
vec_dot of the same build: equal bit for bit, for every tile shape. Serving's
decode (ggml's vec_dot, one column), its prefill and the training forward
(the kernel, batches) then compute one function, whatever the chunk size."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys

import numpy as np
import pytest

from dreamstage import native

Q4_1, Q8_1 = 3, 9


class _TraitsCPU(ctypes.Structure):
    _fields_ = [("from_float", ctypes.c_void_p), ("vec_dot", ctypes.c_void_p), ("vec_dot_type", ctypes.c_int),
                ("nrows", ctypes.c_int64)]


FROM_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
VEC_DOT = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                           ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)


def _libs():
    base = ctypes.CDLL(str(native.lib_dir() / "libggml-base.so"))
    cpu = ctypes.CDLL(str(native.lib_dir() / "libggml-cpu.so"))
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    base.ggml_row_size.restype = ctypes.c_size_t
    cpu.ggml_get_type_traits_cpu.argtypes = [ctypes.c_int]
    cpu.ggml_get_type_traits_cpu.restype = ctypes.POINTER(_TraitsCPU)
    cpu.dream_cpu_q4_1_product.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                                           ctypes.c_int64, ctypes.c_void_p]
    cpu.dream_cpu_q4_1_product.restype = ctypes.c_bool
    cpu.ggml_cpu_init()   # the fp16 table ggml's vec_dot reads
    return base, cpu


def _quantize(cpu, base, qtype: int, rows: np.ndarray) -> tuple[np.ndarray, int]:
    """Rows of float32 into qtype by ggml-cpu's own row quantizer (the one MUL_MAT uses for src1)."""
    conv = FROM_FLOAT(cpu.ggml_get_type_traits_cpu(qtype).contents.from_float)
    n = rows.shape[1]
    rs = base.ggml_row_size(qtype, n)
    out = np.zeros((rows.shape[0], rs), np.uint8)
    src = np.ascontiguousarray(rows, np.float32)
    for i in range(rows.shape[0]):
        conv(src[i].ctypes.data, out[i].ctypes.data, n)
    return out, rs


@pytest.mark.parametrize("n_rows,n_cols,n_in,scale", [(5, 7, 256, 1.0), (16, 16, 576, 0.05), (3, 2, 32, 40.0),
                                                      (33, 9, 1536, 1.0), (2, 4, 64, 1e-3)])
def test_batched_q4_1_equals_ggml_vec_dot_bit_for_bit(n_rows, n_cols, n_in, scale):
    base, cpu = _libs()
    rng = np.random.default_rng(n_rows * 1000 + n_in)
    w = (rng.standard_normal((n_rows, n_in)) * scale + rng.standard_normal((n_rows, 1)) * scale).astype(np.float32)
    x = (rng.standard_normal((n_cols, n_in)) * 2.0).astype(np.float32)
    wq, ws = _quantize(cpu, base, Q4_1, w)
    xq, xs = _quantize(cpu, base, Q8_1, x)
    ours = np.full((n_cols, n_rows), np.nan, np.float32)
    assert cpu.dream_cpu_q4_1_product(wq.ctypes.data, n_rows, xq.ctypes.data, n_cols, n_in, ours.ctypes.data)
    vec_dot = VEC_DOT(cpu.ggml_get_type_traits_cpu(Q4_1).contents.vec_dot)
    theirs = np.zeros_like(ours)
    s = ctypes.c_float()
    for c in range(n_cols):
        for r in range(n_rows):
            vec_dot(n_in, ctypes.addressof(s), 0, wq[r].ctypes.data, 0, xq[c].ctypes.data, 0, 1)
            theirs[c, r] = s.value
    assert np.isfinite(ours).all()
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), np.abs(ours - theirs).max()
    # and both are the product they claim to be (the quantized values' float64 dot)
    ref = w.astype(np.float64) @ x.astype(np.float64).T
    assert np.linalg.norm(ours.T - ref) / np.linalg.norm(ref) < 0.15


def test_batched_q4_1_refuses_bad_shapes():
    base, cpu = _libs()
    buf = np.zeros(4096, np.uint8)
    out = np.zeros(64, np.float32)
    assert not cpu.dream_cpu_q4_1_product(buf.ctypes.data, 2, buf.ctypes.data, 2, 48, out.ctypes.data)
    assert not cpu.dream_cpu_q4_1_product(buf.ctypes.data, 0, buf.ctypes.data, 2, 64, out.ctypes.data)


_PREFILL = r"""
import ctypes, hashlib, sys
import numpy as np
from dreamstage.serving.resident import ResidentConfig, ResidentModel
rm = ResidentModel(ResidentConfig(n_ctx=256, n_seq=1, n_threads=1))
lc = rm.lc
toks = rm.tokenize("The resident model serves chat and, between decode batches, learns from what it is shown. " * 3)
batch = lc.llama_batch_init(len(toks), 0, 1)
batch.n_tokens = len(toks)
for i, t in enumerate(toks):
    batch.token[i] = t; batch.pos[i] = i; batch.n_seq_id[i] = 1; batch.seq_id[i][0] = 0; batch.logits[i] = 1
assert lc.llama_decode(rm.ctx, batch) == 0
logits = np.ctypeslib.as_array(lc.llama_get_logits(rm.ctx), shape=(len(toks) * rm.n_vocab,)).copy()
lc.llama_batch_free(batch)
print(len(toks), hashlib.sha256(logits.tobytes()).hexdigest(), float(np.abs(logits).sum()))
"""


def test_default_model_prefill_logits_identical_with_and_without_the_kernel():
    """The default model is Q4_1: a 60-token prefill's logits, every row, are the same bytes whether its
    products go through the batched kernel or through ggml's vec_dot (DREAMSTAGE_CPU_MUL_MAT=ggml)."""
    outs = []
    for mode in ("", "ggml"):
        env = dict(os.environ, DREAMSTAGE_CPU_MUL_MAT=mode)
        r = subprocess.run([sys.executable, "-c", _PREFILL], env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "differs from ggml" not in r.stderr
        outs.append(r.stdout.split())
    assert int(outs[0][0]) > 40 and float(outs[0][2]) > 0
    assert outs[0] == outs[1]
