// Vectorized CPU kernels for the two element-wise training ops that call
// expf once per element in ggml-cpu: the cross-entropy over the vocabulary
// (49,152 columns per loss row of the default model) and SILU_BACK (the
// feed-forward's gate, 1,536 columns per token per layer; mostly inside
// dream-glu.cpp's one-pass SwiGLU backward, whose body is here too). Together about 4%
// of a default-model step at chunk 256 on one thread. AVX-512 only; other CPUs
// keep ggml's ops.
#include "dream-stage.h"
#include "dream-testing.h"

#include <immintrin.h>

#include <cmath>

namespace {

// e^x, 16 lanes: x = n ln2 + r with |r| <= ln2/2, e^r by its Taylor series to
// r^7 (truncation below 5e-9 relative, under float rounding), times 2^n.
// Inputs are clamped to the float range first.
__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.33654f)), _mm512_set1_ps(88.72283f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    // ln 2 in two parts, so n ln2 is subtracted without losing r's low bits
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

__attribute__((target("avx512f"))) inline __mmask16 tail_mask(int64_t left) {
    return left >= 16 ? (__mmask16) 0xFFFF : (__mmask16) ((1u << left) - 1);
}

// One loss row: sum_i labels[i] * log_softmax(x)[i] = sum labels*x - lse(x) * sum labels.
__attribute__((target("avx512f"))) double ce_row(const float * x, const float * lab, int64_t n) {
    __m512 mx = _mm512_set1_ps(-INFINITY);
    for (int64_t i = 0; i < n; i += 16) {
        mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), tail_mask(n - i), x + i));
    }
    const float m = _mm512_reduce_max_ps(mx);
    const __m512 mv = _mm512_set1_ps(m);
    __m512 se = _mm512_setzero_ps(), sl = _mm512_setzero_ps(), slx = _mm512_setzero_ps();
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 xv = _mm512_maskz_loadu_ps(k, x + i), lv = _mm512_maskz_loadu_ps(k, lab + i);
        se = _mm512_add_ps(se, _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(xv, mv))));
        sl = _mm512_add_ps(sl, lv);
        slx = _mm512_fmadd_ps(lv, _mm512_sub_ps(xv, mv), slx);
    }
    const double lse = std::log((double) _mm512_reduce_add_ps(se));
    return (double) _mm512_reduce_add_ps(slx) - lse * (double) _mm512_reduce_add_ps(sl);
}

// dst[r] = row r's sum of labels * log_softmax(logits), threads by rows
void dream_ce_rows_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * x = dst->src[0];
    const ggml_tensor * lab = dst->src[1];
    const int64_t nr = ggml_nrows(x), nc = x->ne[0];
    for (int64_t r = ith; r < nr; r += nth) {
        ((float *) dst->data)[r] = (float) ce_row((const float *) ((const char *) x->data + r * x->nb[1]),
                                                  (const float *) ((const char *) lab->data + r * lab->nb[1]), nc);
    }
}

// dx = dy * s * (1 + x (1 - s)), s = sigmoid(x): ggml's SILU_BACK (src0 = dy, src1 = x)
__attribute__((target("avx512f"))) void silu_back_row(float * dx, const float * x, const float * dy, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 xv = _mm512_maskz_loadu_ps(k, x + i), gv = _mm512_maskz_loadu_ps(k, dy + i);
        const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), xv))));
        const __m512 d = _mm512_mul_ps(_mm512_mul_ps(gv, s), _mm512_fmadd_ps(xv, _mm512_sub_ps(one, s), one));
        _mm512_mask_storeu_ps(dx + i, k, d);
    }
}

void dream_silu_back_op(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * dy = dst->src[0];
    const ggml_tensor * x = dst->src[1];
    const int64_t nr = ggml_nrows(dst), nc = dst->ne[0];
    for (int64_t r = ith; r < nr; r += nth) {
        // rows by their flat index: all three are contiguous (checked before the rewrite)
        silu_back_row((float *) dst->data + r * nc, (const float *) x->data + r * nc, (const float *) dy->data + r * nc, nc);
    }
}

} // namespace

bool dream_cpu_exp_ops_rewrite(ggml_context * ctx, ggml_tensor * n) {
    if (!dream_cpu_avx512()) {
        return false;
    }
    if (n->op == GGML_OP_CROSS_ENTROPY_LOSS) {
        ggml_tensor * x = n->src[0];
        ggml_tensor * lab = n->src[1];
        if (x->type != GGML_TYPE_F32 || lab->type != GGML_TYPE_F32 || x->nb[0] != sizeof(float) ||
            lab->nb[0] != sizeof(float) || !ggml_are_same_shape(x, lab) || ggml_n_dims(x) > 2) {
            return false;
        }
        // the loss is -(1/rows) sum over rows: per-row sums from the kernel, then ggml's SUM and SCALE
        ggml_tensor * args[2] = { x, lab };
        ggml_tensor * rows = ggml_custom_4d(ctx, GGML_TYPE_F32, x->ne[1], 1, 1, 1, args, 2, dream_ce_rows_op,
                                            GGML_N_TASKS_MAX, nullptr);
        dream_take_op(n, ggml_scale(ctx, ggml_sum(ctx, rows), -1.0f / (float) x->ne[1]));
        return true;
    }
    if (n->op == GGML_OP_SILU_BACK) {
        ggml_tensor * dy = n->src[0];
        ggml_tensor * x = n->src[1];
        if (n->type != GGML_TYPE_F32 || dy->type != GGML_TYPE_F32 || x->type != GGML_TYPE_F32 || !ggml_is_contiguous(n) ||
            !ggml_is_contiguous(dy) || !ggml_is_contiguous(x) || !ggml_are_same_shape(n, dy) || !ggml_are_same_shape(n, x)) {
            return false;
        }
        ggml_tensor * args[2] = { dy, x };
        dream_take_op(n, ggml_custom_4d(ctx, GGML_TYPE_F32, n->ne[0], n->ne[1], n->ne[2], n->ne[3], args, 2,
                                        dream_silu_back_op, GGML_N_TASKS_MAX, nullptr));
        return true;
    }
    return false;
}

namespace {
// SwiGLU's backward (dream-glu.cpp): t = dy u; dg = t s (1 + g (1 - s)), du = dy g s
__attribute__((target("avx512f"))) void swiglu_back_all(const float * dy, const float * g, const float * u, float * dg,
                                                       float * du, int64_t n) {
    const __m512 one = _mm512_set1_ps(1.0f);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        const __m512 yv = _mm512_maskz_loadu_ps(k, dy + i), xv = _mm512_maskz_loadu_ps(k, g + i),
                     uv = _mm512_maskz_loadu_ps(k, u + i);
        const __m512 s = _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), xv))));
        const __m512 d = _mm512_mul_ps(_mm512_mul_ps(_mm512_mul_ps(yv, uv), s), _mm512_fmadd_ps(xv, _mm512_sub_ps(one, s), one));
        _mm512_mask_storeu_ps(dg + i, k, d);
        _mm512_mask_storeu_ps(du + i, k, _mm512_mul_ps(yv, _mm512_mul_ps(xv, s)));
    }
}

__attribute__((target("avx512f"))) void exp_all(const float * x, int64_t n, float * out) {
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 k = tail_mask(n - i);
        _mm512_mask_storeu_ps(out + i, k, exp16(_mm512_maskz_loadu_ps(k, x + i)));
    }
}
} // namespace

bool dream_cpu_exp_check(const float * x, int64_t n, float * out) {
    if (!dream_cpu_avx512() || !x || !out || n <= 0) {
        return false;
    }
    exp_all(x, n, out);
    return true;
}

bool dream_cpu_swiglu_back(const float * dy, const float * g, const float * u, float * dg, float * du, int64_t n) {
    if (!dream_cpu_avx512()) {
        return false;
    }
    swiglu_back_all(dy, g, u, dg, du, n);
    return true;
}
