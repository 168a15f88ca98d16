"""The CPU kernel of the backward through a frozen quantized weight
(dreamstage/ggml_ext/dream-cpu-backward.cpp) against an independent reference:
weights quantized by ggml, dequantized by the `gguf` package's NumPy code, and
dx = W^T dy computed in float64."""
from __future__ import annotations

import ctypes
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from dreamstage import native

LEGACY = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL]
KQUANTS = [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS]


def _quantize(qtype: Q, w: np.ndarray) -> np.ndarray:
    """ggml's own quantizer (libggml-base), row by row; returns the GGUF bytes."""
    base = ctypes.CDLL(str(native.lib_dir() / "libggml-base.so"))
    base.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
    base.ggml_row_size.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    n_out, n_in = w.shape
    out = np.zeros(n_out * base.ggml_row_size(int(qtype), n_in), np.uint8)
    src = np.ascontiguousarray(w, np.float32)
    written = base.ggml_quantize_chunk(int(qtype), src.ctypes.data, out.ctypes.data, 0, n_out, n_in, None)
    assert written == out.size
    return out


def _product(qtype: Q, wq: np.ndarray, n_in: int, n_out: int, dy: np.ndarray) -> np.ndarray:
    L = native.lib()
    dx = np.full((dy.shape[0], n_in), np.nan, np.float32)
    f32p = ctypes.POINTER(ctypes.c_float)
    ok = L.dream_backward_product(int(qtype), wq.ctypes.data, n_in, n_out, dy.ctypes.data_as(f32p), dy.shape[0],
                                  dx.ctypes.data_as(f32p))
    assert ok
    return dx


@pytest.mark.parametrize("qtype,n_in,n_out,n_tok", [(t, 576, 96, 7) for t in LEGACY] +
                         [(t, 512, 80, 9) for t in KQUANTS] + [(Q.Q4_1, 64, 1000, 4), (Q.Q8_0, 1536, 33, 1),
                          (Q.Q4_1, 576, 96, 64), (Q.Q8_0, 576, 40, 49)])
def test_backward_product_matches_float64_reference(qtype, n_in, n_out, n_tok):
    _check(qtype, n_in, n_out, n_tok)


# Q4_0, Q4_1 and Q8_0 take the fused kernel on AVX-512 CPUs: one register tile
# per token count up to 8, then tiles of 8 and a remainder
@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
@pytest.mark.parametrize("n_tok", [1, 2, 3, 5, 8, 11, 17])
def test_fused_kernel_every_token_tile(qtype, n_tok):
    _check(qtype, 576, 200, n_tok)


def test_panel_kernel_where_the_fused_one_is_switched_off():
    """DREAMSTAGE_CPU_BACKWARD=panel: the kernel that CPUs without AVX-512 use, on the fused types too."""
    code = ("import sys; sys.path.insert(0, 'tests'); import test_cpu_backward as t; from gguf import "
            "GGMLQuantizationType as Q\n"
            "for q in (Q.Q4_0, Q.Q4_1, Q.Q8_0, Q.Q4_K):\n    for n in (1, 3, 9):\n        t._check(q, 512, 96, n)\n"
            "print('ok')")
    env = dict(os.environ, DREAMSTAGE_CPU_BACKWARD="panel")
    r = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


def _check(qtype: Q, n_in: int, n_out: int, n_tok: int) -> None:
    rng = np.random.default_rng(int(qtype) * 7 + n_in)
    w = rng.standard_normal((n_out, n_in)).astype(np.float32) / np.sqrt(n_in)
    dy = rng.standard_normal((n_tok, n_out)).astype(np.float32)
    wq = _quantize(qtype, w)
    w_deq = dequantize(wq.reshape(n_out, -1), qtype).astype(np.float64)   # the gguf package's own dequantizer
    ref = dy.astype(np.float64) @ w_deq                                    # dx[t, i] = sum_o dy[t, o] W[o, i]
    dx = _product(qtype, wq, n_in, n_out, dy)
    rel = np.linalg.norm(dx - ref) / np.linalg.norm(ref)
    # float32 sums over n_out products: a few ulps of the row norm
    assert rel < 5e-6, f"{qtype.name}: rel L2 {rel:.2e}"
    assert np.all(np.isfinite(dx))


def test_backward_product_refuses_what_it_cannot_take():
    L = native.lib()
    dy = np.ones((2, 4), np.float32)
    dx = np.zeros((2, 40), np.float32)
    f32p = ctypes.POINTER(ctypes.c_float)
    w = np.zeros(1024, np.uint8)
    # F32 is not a quantized type; 40 columns are not whole Q8_0 blocks of 32
    assert not L.dream_backward_product(0, w.ctypes.data, 40, 4, dy.ctypes.data_as(f32p), 2, dx.ctypes.data_as(f32p))
    assert not L.dream_backward_product(int(Q.Q8_0), w.ctypes.data, 40, 4, dy.ctypes.data_as(f32p), 2,
                                        dx.ctypes.data_as(f32p))
    assert not dx.any()



@pytest.mark.parametrize("ne0,ne1,nk,b_transposed", [(576, 8, 32, False), (8, 576, 32, True), (64, 37, 129, False),
                                                    (33, 13, 5, True), (1, 1, 1, False), (100, 25, 256, True)])
def test_f32_out_prod_kernel_matches_float64(ne0, ne1, nk, b_transposed):
    """dst[i1][i0] = sum_k a[k][i0] b[i1][k]: the register-tiled F32 OUT_PROD against NumPy in float64,
    with a's rows padded (a stride past ne0) and b read along either of its axes."""
    L = native.lib()
    rng = np.random.default_rng(ne0 * 31 + ne1)
    a_k = ne0 + 3
    a = rng.standard_normal((nk, a_k)).astype(np.float32)
    if b_transposed:   # b stored k-major: element (i1, k) at k * ne1 + i1
        b_store = rng.standard_normal((nk, ne1)).astype(np.float32)
        b, b_i, b_k = b_store.T, 1, ne1
    else:
        b_store = rng.standard_normal((ne1, nk)).astype(np.float32)
        b, b_i, b_k = b_store, nk, 1
    dst = np.full((ne1, ne0), np.nan, np.float32)
    f32p = ctypes.POINTER(ctypes.c_float)
    ok = L.dream_out_prod_f32(a.ctypes.data_as(f32p), ne0, nk, a_k, b_store.ctypes.data_as(f32p), ne1, b_i, b_k,
                              dst.ctypes.data_as(f32p))
    if not ok:
        pytest.skip("no AVX2 on this CPU: training graphs keep ggml's OUT_PROD")
    ref = b.astype(np.float64) @ a[:, :ne0].astype(np.float64)
    rel = np.linalg.norm(dst - ref) / np.linalg.norm(ref)
    assert rel < 1e-6, rel
    assert not L.dream_out_prod_f32(a.ctypes.data_as(f32p), ne0, nk, ne0 - 1, b_store.ctypes.data_as(f32p), ne1,
                                    b_i, b_k, dst.ctypes.data_as(f32p))


def test_vectorized_exp_against_libm():
    """The e^x of the CPU cross-entropy and SILU_BACK kernels, against NumPy's float64 exp: within 2 ulp
    over the float range, 0 and +inf at the clamped ends, every tail length."""
    L = native.lib()
    f32p = ctypes.POINTER(ctypes.c_float)
    rng = np.random.default_rng(7)
    x = np.concatenate([rng.uniform(-87, 88, 20000), rng.uniform(-1, 1, 5000),
                        [0.0, -0.0, 1e-30, -1e-30]]).astype(np.float32)
    out = np.full_like(x, np.nan)
    if not L.dream_cpu_exp_check(x.ctypes.data_as(f32p), x.size, out.ctypes.data_as(f32p)):
        pytest.skip("no AVX-512 on this CPU: training graphs keep ggml's ops")
    ref = np.exp(x.astype(np.float64))
    rel = np.abs(out.astype(np.float64) - ref) / ref
    assert rel.max() < 2.5e-7, rel.max()
    for n in (1, 15, 17):
        part = np.full(n, np.nan, np.float32)
        assert L.dream_cpu_exp_check(x.ctypes.data_as(f32p), n, part.ctypes.data_as(f32p))
        assert np.array_equal(part, out[:n])
    ends = np.array([-200.0, 200.0], np.float32)
    e = np.zeros(2, np.float32)
    assert L.dream_cpu_exp_check(ends.ctypes.data_as(f32p), 2, e.ctypes.data_as(f32p))
    assert e[0] < 1e-37 and e[1] > 1e38 and np.isfinite(e).all()


def _gather(L, qtype: Q, raw: np.ndarray, n_embd: int, n_rows: int, ids: np.ndarray, rewrite: bool,
            threads: int = 4) -> tuple[bool, np.ndarray, bool]:
    out = np.full((ids.size, n_embd), np.nan, np.float32)
    done = ctypes.c_bool(False)
    ok = L.dream_cpu_get_rows_check(int(qtype), raw.ctypes.data, n_embd, n_rows, ids.ctypes.data, ids.size, threads,
                                    rewrite, out.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), ctypes.byref(done))
    return ok, out, done.value


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q6_K, Q.Q4_K])
def test_token_embeddings_gathered_on_every_thread_match_ggml_and_numpy(qtype):
    """A training graph's GET_ROWS of host-resident embeddings (dream-cpu-rows.cpp, one task in
    ggml-cpu) runs split over the backend's threads: bit for bit ggml's op, rows as the `gguf`
    package's NumPy code dequantizes them; repeated ids and both ends; fewer than 32 rows (a
    decode's) and bad ids keep ggml's op or are refused."""
    L = native.lib()
    rng = np.random.default_rng(int(qtype))
    n_embd, n_rows = 512, 300
    w = rng.standard_normal((n_rows, n_embd)).astype(np.float32)
    raw = {Q.F32: lambda: w.view(np.uint8).reshape(n_rows, -1),
           Q.F16: lambda: w.astype(np.float16).view(np.uint8).reshape(n_rows, -1)}.get(
               qtype, lambda: _quantize(qtype, w))()
    raw = np.ascontiguousarray(raw)
    ids = rng.integers(0, n_rows, 77).astype(np.int32)
    ids[:4] = [0, n_rows - 1, 0, 5]
    ref = dequantize(raw.reshape(n_rows, -1), qtype).reshape(n_rows, n_embd)[ids]
    for threads in (1, 3, 8):
        ok, fast, done = _gather(L, qtype, raw, n_embd, n_rows, ids, True, threads)
        assert ok and done
        ok, plain, done = _gather(L, qtype, raw, n_embd, n_rows, ids, False, threads)
        assert ok and not done
        assert np.array_equal(fast.view(np.uint32), plain.view(np.uint32))
        assert np.linalg.norm(fast - ref) / np.linalg.norm(ref) < 1e-6
    ok, few, done = _gather(L, qtype, raw, n_embd, n_rows, ids[:31], True)
    assert ok and not done and np.array_equal(few, fast[:31])
    bad = ids.copy()
    bad[40] = n_rows
    ok, out, _ = _gather(L, qtype, raw, n_embd, n_rows, bad, True)
    assert not ok and np.isnan(out).all()


def _swiglu_grads(L, g, u, w, fused: bool, threads: int) -> tuple[np.ndarray, np.ndarray, int]:
    f32p = ctypes.POINTER(ctypes.c_float)
    n_tok, n_ff = g.shape
    dg, du = np.full_like(g, np.nan), np.full_like(g, np.nan)
    count = ctypes.c_int32(-1)
    assert L.dream_swiglu_back_check(g.ctypes.data_as(f32p), u.ctypes.data_as(f32p), w.ctypes.data_as(f32p),
                                     n_ff, n_tok, threads, fused,
                                     dg.ctypes.data_as(f32p), du.ctypes.data_as(f32p), ctypes.byref(count))
    return dg, du, count.value


@pytest.mark.parametrize("n_ff,n_tok", [(1536, 64), (1000, 37), (7, 1)])
def test_swiglu_backward_in_one_node_matches_the_closed_form_and_ggml(n_ff, n_tok):
    """SwiGLU's backward as one node (dream-glu.cpp; what a training graph's feed-forward
    gate gets on every backend) against the closed form in float64 and against ggml's own
    four-op backward: relative L2 over each whole gradient, both nonzero, on 1 and 3
    threads; the graph the check builds with `fused` off (ggml's own backward, which no
    training graph uses) has no fused node."""
    L = native.lib()
    rng = np.random.default_rng(n_ff)
    g, u, w = (rng.normal(0.0, 2.0, (n_tok, n_ff)).astype(np.float32) for _ in range(3))
    g[0, :3] = [-100.0, 0.0, 90.0]                      # saturated sigmoid both ways, and zero
    x = g.astype(np.float64)
    s = 1.0 / (1.0 + np.exp(-x))
    ref_g = w * u.astype(np.float64) * s * (1.0 + x * (1.0 - s))
    ref_u = w * x * s
    plain_g, plain_u, none = _swiglu_grads(L, g, u, w, False, 1)
    assert none == 0
    rel = lambda a, b: np.linalg.norm(a - b) / np.linalg.norm(b)   # noqa: E731
    for threads in (1, 3):
        dg, du, count = _swiglu_grads(L, g, u, w, True, threads)
        assert count == 1
        assert np.isfinite(dg).all() and np.isfinite(du).all()
        assert np.abs(dg).max() > 0 and np.abs(du).max() > 0
        assert rel(dg, ref_g) < 1e-6 and rel(du, ref_u) < 1e-6, (rel(dg, ref_g), rel(du, ref_u))
        assert rel(dg, plain_g) < 1e-6 and rel(du, plain_u) < 1e-6
    assert rel(plain_g, ref_g) < 1e-6 and rel(plain_u, ref_u) < 1e-6


def test_swiglu_backward_check_refuses_bad_sizes():
    L = native.lib()
    f32p = ctypes.POINTER(ctypes.c_float)
    a = np.zeros(4, np.float32)
    c = ctypes.c_int32()
    p = a.ctypes.data_as(f32p)
    assert not L.dream_swiglu_back_check(p, p, p, 0, 4, 1, True, p, p, ctypes.byref(c))
    assert not L.dream_swiglu_back_check(p, p, p, 4, 1, 0, True, p, p, ctypes.byref(c))
    assert not L.dream_swiglu_back_check(p, p, p, 1 << 14, 1 << 13, 1, True, p, p, ctypes.byref(c))
