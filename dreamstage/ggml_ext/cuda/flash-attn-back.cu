// dreamstage: the backward of fused attention on CUDA, for training graphs.
//
// ggml's FLASH_ATTN_EXT computes O = softmax(scale * Q K^T + mask) V without
// keeping the score matrix; ggml has no backward for it, so a training graph
// has had to run attention as explicit products, whose score matrices (T x T
// per head, in F32) dominate a long chunk's step. This file is the backward
// (dream-fattn.cpp builds the graph node): from Q, K, V, the mask, the output
// O and its gradient dO it recomputes the scores tile by tile and returns dQ,
// dK and dV, never holding more than a 64 x 64 tile of them:
//
//   lse_i = log sum_j exp(s_ij),  s_ij = scale * q_i . k_j + m_ij
//   D_i   = dO_i . O_i
//   P_ij  = exp(s_ij - lse_i)
//   dV_j  = sum_i P_ij dO_i
//   dS_ij = P_ij (dO_i . v_j - D_i)
//   dQ_i  = scale sum_j dS_ij k_j,   dK_j = scale sum_i dS_ij q_i
//
// Arithmetic. Every product runs on tensor cores (mma.sync m16n8k16) with F16
// operands and F32 accumulation; the scores, P, dP and dS stay in registers in
// F32 and are rounded to F16 only as operands. F16 carries the mantissa TF32
// carries (10 bits), so this lands where a TF32 product lands, but not F16's
// range: gradients of a loss averaged over thousands of tokens sit below F16's
// smallest normal number. So dO is multiplied by a power of two per head,
// chosen from its largest magnitude (fa_back_dvec finds it) to bring that to
// [0.5, 1), and the sums that carry dO (dV, dS, hence dK and dQ) are divided
// by it where they are written. Q is rounded to F16 as the forward kernel
// rounds it; K and V are F16 already.
//
// Layouts are ggml's: Q [D, T, H] (any strides), K and V [D, Tk, Hk] F16
// (any row and head strides), mask [Tk, >= T] F16 (one for every head), O and
// dO [D, H, T] contiguous F32. Grouped-query heads: q head h reads kv head
// h / (H / Hk). Outputs F32 with a row stride and a head stride each (16-byte
// multiples): dQ [D, T, H], dK and dV [D, Tk, Hk], each head-major ([D, T, H]
// in memory) or token-major ([D, H, T]). The ggml op writes dQ token-major, the
// order Q had before attention permuted it, so its gradient goes back with no
// copy (dream-fattn.cpp says why dK and dV stay head-major).
#ifndef DREAM_FA_NO_GGML
#include "out-prod.cuh"
#endif

#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int BR = 64;      // rows of a query tile
constexpr int BC = 64;      // rows of a key tile
constexpr int WARPS = 4;    // a block: each warp owns 16 rows of the tile it iterates over
constexpr int THREADS = 32 * WARPS;
constexpr int LDT = 64 + 8; // row stride (halves) of a 64 x 64 F16 tile: the mask, dS^T

// Shared tiles are F16 with rows padded by 8 halves (16 bytes), so the eight
// rows an ldmatrix reads fall in eight different groups of four banks.
template <int D> __host__ __device__ constexpr int ldh() {
    return D + 8;
}

// ---- tensor-core fragments (PTX ISA, "mma.m16n8k16" and "ldmatrix") -------
// For a lane l, g = l / 4 and t = l % 4. An m16n8k16 accumulator holds rows g
// and g + 8, columns 2t and 2t + 1 of a 16 x 8 tile: c[0], c[1] and c[2], c[3].
// The A operand (16 x 16) holds the same positions of two such tiles side by
// side, as half pairs, so an accumulator pair becomes an A operand in
// registers (pack_a). B (16 x 8) holds rows 2t, 2t + 1 and 2t + 8, 2t + 9 of
// column g.

__device__ __forceinline__ uint32_t smem_addr(const void * p) {
    return (uint32_t) __cvta_generic_to_shared(p);
}

__device__ __forceinline__ void ldsm(uint32_t (&r)[4], const half * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void ldsm_t(uint32_t (&r)[4], const half * p) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(smem_addr(p)));
}

__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
                 "{%0, %1, %2, %3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack(float lo, float hi) {
    const half2 h = __floats2half2_rn(lo, hi);
    uint32_t u;
    std::memcpy(&u, &h, sizeof(u));
    return u;
}

// the A operand for columns [16 k, 16 k + 16) of a 16 x 64 F32 accumulator
__device__ __forceinline__ void pack_a(uint32_t (&a)[4], const float (&c)[8][4], int k) {
    a[0] = pack(c[2 * k][0], c[2 * k][1]);
    a[1] = pack(c[2 * k][2], c[2 * k][3]);
    a[2] = pack(c[2 * k + 1][0], c[2 * k + 1][1]);
    a[3] = pack(c[2 * k + 1][2], c[2 * k + 1][3]);
}

// A (16 x 16) from a row-major tile at p (row stride ld halves)
__device__ __forceinline__ void frag_a(uint32_t (&a)[4], const half * p, int ld) {
    const int l = threadIdx.x % 32;
    ldsm(a, p + (l % 8 + (l / 8) % 2 * 8) * ld + l / 16 * 8);
}

// A (16 x 16) from a tile at p that holds A transposed (p[k * ld + m] = A[m][k])
__device__ __forceinline__ void frag_a_t(uint32_t (&a)[4], const half * p, int ld) {
    const int l = threadIdx.x % 32;
    ldsm_t(a, p + (l % 8 + l / 16 * 8) * ld + (l / 8) % 2 * 8);
}

// B for two 16 x 8 tiles side by side (b[0], b[1] the first, b[2], b[3] the
// second), from a tile at p that holds B transposed (p[n * ld + k] = B[k][n]):
// a row-major operand's rows, as in Q K^T
__device__ __forceinline__ void frag_b2(uint32_t (&b)[4], const half * p, int ld) {
    const int l = threadIdx.x % 32;
    ldsm(b, p + (l % 8 + l / 16 * 8) * ld + (l / 8) % 2 * 8);
}

// the same from a row-major B (p[k * ld + n] = B[k][n]), as in P V
__device__ __forceinline__ void frag_b2_t(uint32_t (&b)[4], const half * p, int ld) {
    const int l = threadIdx.x % 32;
    ldsm_t(b, p + (l % 8 + (l / 8) % 2 * 8) * ld + l / 16 * 8);
}

// c[8][4] += A B^T for one warp: A 16 rows of K halves at a, B 64 rows of K halves at b
template <int K> __device__ __forceinline__ void mm_abt(float (&c)[8][4], const half * a, int la, const half * b, int lb) {
#pragma unroll
    for (int kk = 0; kk < K / 16; ++kk) {
        uint32_t af[4];
        frag_a(af, a + kk * 16, la);
#pragma unroll
        for (int np = 0; np < 4; ++np) {
            uint32_t bf[4];
            frag_b2(bf, b + np * 16 * lb + kk * 16, lb);
            mma(c[2 * np], af, bf[0], bf[1]);
            mma(c[2 * np + 1], af, bf[2], bf[3]);
        }
    }
}

// c[N][4] += X B for one warp: X the 16 x 64 F32 accumulator x (as F16), B a
// row-major 64 x 8N tile at b
template <int N> __device__ __forceinline__ void mm_xb(float (&c)[N][4], const float (&x)[8][4], const half * b, int lb) {
#pragma unroll
    for (int kk = 0; kk < 4; ++kk) {
        uint32_t af[4];
        pack_a(af, x, kk);
#pragma unroll
        for (int np = 0; np < N / 2; ++np) {
            uint32_t bf[4];
            frag_b2_t(bf, b + kk * 16 * lb + np * 16, lb);
            mma(c[2 * np], af, bf[0], bf[1]);
            mma(c[2 * np + 1], af, bf[2], bf[3]);
        }
    }
}

// dst[0..3] += s * v, atomically (one 16-byte atomic where the GPU has them: sm_90)
__device__ __forceinline__ void add4(float * dst, float4 v, float s) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    atomicAdd((float4 *) dst, make_float4(s * v.x, s * v.y, s * v.z, s * v.w));
#else
    atomicAdd(dst, s * v.x);
    atomicAdd(dst + 1, s * v.y);
    atomicAdd(dst + 2, s * v.z);
    atomicAdd(dst + 3, s * v.w);
#endif
}

// adds s * c, a 16 x 8 accumulator, to rows [r0, r0 + 16) of a row-major F32
// matrix at base (row stride ld, 16-byte aligned rows), rows from n on left
// out. Lane pairs swap halves so each lane adds four adjacent columns at once.
__device__ __forceinline__ void add_tile(float * base, int64_t ld, const float (&c)[4], float s, int r0, int n) {
    const int l = threadIdx.x % 32, g = l / 4, t = l % 4;
    const bool odd = t & 1;
    const float y0 = __shfl_xor_sync(0xffffffff, odd ? c[0] : c[2], 1);
    const float y1 = __shfl_xor_sync(0xffffffff, odd ? c[1] : c[3], 1);
    const int r = r0 + g + (odd ? 8 : 0);
    if (r < n) {
        add4(base + (int64_t) r * ld + 2 * (t & ~1),
             odd ? make_float4(y0, y1, c[2], c[3]) : make_float4(c[0], c[1], y0, y1), s);
    }
}

struct fa_args {
    const float * q;  int64_t q_row, q_head;            // strides in floats
    const half  * k;  int64_t k_row, k_head;            // strides in halves
    const half  * v;  int64_t v_row, v_head;
    const half  * mask; int64_t mask_row;               // nullptr: no mask
    const float * o;  const float * d_o;                // [D, H, T] contiguous
    float * dq; float * dk; float * dv;                  // outputs (zeroed before the main kernel)
    int64_t dq_row, dq_head, dkv_row, dkv_head;         // their strides in floats (dK and dV alike)
    float * lse; float * dvec;                          // [H, T] scratch
    uint8_t * cls;                                      // [T / 64][Tk / 64] tile classes (TILE_*)
    uint32_t * amax;                                    // [H]: the largest |dO| of each head, as F32 bits
    float scale;
    int T, Tk, H, Hk;
    bool q_vec, kv_vec;                                 // rows aligned for 16-byte loads
};

// what a 64 x 64 tile of the mask holds: nothing to attend (skipped), no mask
// at all (every entry 0, nothing to load), or anything else (loaded)
constexpr uint8_t TILE_EMPTY = 0, TILE_FULL = 1, TILE_MIXED = 2;

__device__ __forceinline__ int n_kblocks(const fa_args & a) {
    return (a.Tk + BC - 1) / BC;
}

// the power of two that takes head h's largest |dO| into [0.5, 1) (1 for an all-zero dO)
__device__ __forceinline__ float do_scale(const fa_args & a, int h) {
    const float m = __uint_as_float(a.amax[h]);
    if (!(m > 0.f) || !isfinite(m)) {
        return 1.f;
    }
    int e = 0;
    frexpf(m, &e);
    return ldexpf(1.f, -e);
}

// one block per tile: classify it (entries past T or Tk count as -inf)
__global__ void __launch_bounds__(THREADS) fa_back_classify(fa_args a) {
    const int i0 = blockIdx.x * BR, j0 = blockIdx.y * BC;
    int finite = 0, nonzero = 0;
    for (int e = threadIdx.x; e < 64 * 64; e += THREADS) {
        const int i = e / 64, j = e % 64;
        float m = -INFINITY;
        if (i0 + i < a.T && j0 + j < a.Tk) {
            m = a.mask ? __half2float(a.mask[(int64_t) (i0 + i) * a.mask_row + j0 + j]) : 0.f;
        }
        finite |= m != -INFINITY;
        nonzero |= m != 0.f;
    }
    finite = __syncthreads_or(finite);
    nonzero = __syncthreads_or(nonzero);
    if (threadIdx.x == 0) {
        a.cls[blockIdx.x * gridDim.y + blockIdx.y] = !finite ? TILE_EMPTY : nonzero ? TILE_MIXED : TILE_FULL;
    }
}

// D_i = dO_i . O_i, and each head's largest |dO|: one block per (head, 64 rows),
// a warp per row in turn, one atomic per block
template <int D> __global__ void __launch_bounds__(THREADS) fa_back_dvec(fa_args a) {
    const int h = blockIdx.x, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    __shared__ float wmax[WARPS];
    float m = 0.f;
    for (int t = blockIdx.y * 64 + warp; t < min(a.T, (int) blockIdx.y * 64 + 64); t += WARPS) {
        const float * o = a.o + ((int64_t) t * a.H + h) * D;
        const float * g = a.d_o + ((int64_t) t * a.H + h) * D;
        float s = 0.f;
#pragma unroll
        for (int d = lane; d < D; d += 32) {
            s += o[d] * g[d];
            m = fmaxf(m, fabsf(g[d]));
        }
        for (int off = 16; off > 0; off >>= 1) {
            s += __shfl_xor_sync(0xffffffff, s, off);
        }
        if (lane == 0) {
            a.dvec[(int64_t) h * a.T + t] = s;
        }
    }
    for (int off = 16; off > 0; off >>= 1) {
        m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, off));
    }
    if (lane == 0) {
        wmax[warp] = m;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < WARPS; ++w) {
            m = fmaxf(m, wmax[w]);
        }
        atomicMax(a.amax + h, __float_as_uint(m));   // non-negative floats order as their bits
    }
}

// rows [r0, r0 + 64) of a [*, D] F32 matrix with row stride `row`, times mul,
// into an F16 tile (ld D + 8); zeros past n
template <int D> __device__ __forceinline__ void load_rows_f32(half * dst, const float * src, int64_t row, int r0, int n,
                                                               bool vec, float mul) {
    constexpr int PER = 64 * (D / 4) / THREADS;
#pragma unroll
    for (int it = 0; it < PER; ++it) {
        const int e = threadIdx.x + it * THREADS;
        const int r = e / (D / 4), c = (e % (D / 4)) * 4;
        float4 x = make_float4(0.f, 0.f, 0.f, 0.f);
        if (r0 + r < n) {
            const float * p = src + (int64_t) (r0 + r) * row + c;
            x = vec ? __ldg((const float4 *) p) : make_float4(p[0], p[1], p[2], p[3]);
        }
        const uint2 u = make_uint2(pack(mul * x.x, mul * x.y), pack(mul * x.z, mul * x.w));
        *(uint2 *) (dst + r * ldh<D>() + c) = u;
    }
}

// the same from an F16 matrix (row stride in halves)
template <int D> __device__ __forceinline__ void load_rows_f16(half * dst, const half * src, int64_t row, int r0, int n,
                                                               bool vec) {
    constexpr int PER = 64 * (D / 8) / THREADS;
#pragma unroll
    for (int it = 0; it < PER; ++it) {
        const int e = threadIdx.x + it * THREADS;
        const int r = e / (D / 8), c = (e % (D / 8)) * 8;
        uint4 u = make_uint4(0, 0, 0, 0);
        if (r0 + r < n) {
            const half * p = src + (int64_t) (r0 + r) * row + c;
            if (vec) {
                u = __ldg((const uint4 *) p);
            } else {
                half h[8];
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    h[k] = p[k];
                }
                std::memcpy(&u, h, sizeof(u));
            }
        }
        *(uint4 *) (dst + r * ldh<D>() + c) = u;
    }
}

// a TILE_MIXED tile of the mask, m[i][j] for queries [i0, +64) and keys [j0, +64), -inf past the ends
__device__ __forceinline__ void load_mask(half * dst, const fa_args & a, int i0, int j0) {
    for (int e = threadIdx.x; e < 64 * 64; e += THREADS) {
        const int i = e / 64, j = e % 64;
        half m = __float2half(-INFINITY);
        if (i0 + i < a.T && j0 + j < a.Tk) {
            m = a.mask ? a.mask[(int64_t) (i0 + i) * a.mask_row + j0 + j] : __float2half(0.f);
        }
        dst[i * LDT + j] = m;
    }
}

// lse_i for a tile of 64 queries of one head: the scores again, key tile by key tile
template <int D> __global__ void __launch_bounds__(THREADS) fa_back_lse(fa_args a) {
    constexpr int LH = ldh<D>();
    extern __shared__ __align__(16) unsigned char smem_raw[];
    half * qs = (half *) smem_raw;              // [64][LH]
    half * ks = qs + 64 * LH;                   // [64][LH]
    half * ms = ks + 64 * LH;                   // [64][LDT]
    // the last query tiles first: under a causal mask they see the most keys (the
    // longest blocks start first, so the last wave is short)
    const int ib = gridDim.y - 1 - blockIdx.y, i0 = ib * BR, h = blockIdx.x, grp = h / (a.H / a.Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    load_rows_f32<D>(qs, a.q + h * a.q_head, a.q_row, i0, a.T, a.q_vec, 1.f);
    // each lane keeps the running max and sum of rows g and g + 8 of its warp's
    // 16, over its columns; the four lanes of a row agree after each tile
    float m_run[2] = { -INFINITY, -INFINITY }, l_run[2] = { 0.f, 0.f };
    const uint8_t * cls = a.cls + ib * n_kblocks(a);
    for (int jb = 0; jb < n_kblocks(a); ++jb) {
        const uint8_t c = cls[jb];
        if (c == TILE_EMPTY) {
            continue;
        }
        __syncthreads();                        // the tiles of the last round are read
        if (c == TILE_MIXED) {
            load_mask(ms, a, i0, jb * BC);
        }
        load_rows_f16<D>(ks, a.k + grp * a.k_head, a.k_row, jb * BC, a.Tk, a.kv_vec);
        __syncthreads();
        float s[8][4] = {};
        mm_abt<D>(s, qs + warp * 16 * LH, LH, ks, LH);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const half * mrow = ms + (warp * 16 + g + 8 * r) * LDT + 2 * t;
            float mx = -INFINITY;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    float x = a.scale * s[j][2 * r + e];
                    if (c == TILE_MIXED) {
                        x += __half2float(mrow[8 * j + e]);
                    }
                    s[j][2 * r + e] = x;
                    mx = fmaxf(mx, x);
                }
            }
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            const float m_new = fmaxf(m_run[r], mx);
            float sum = 0.f;
            if (m_new != -INFINITY) {           // else the row has seen no key yet
#pragma unroll
                for (int j = 0; j < 8; ++j) {
                    sum += __expf(s[j][2 * r] - m_new) + __expf(s[j][2 * r + 1] - m_new);
                }
            }
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
            if (m_new != -INFINITY) {
                l_run[r] = l_run[r] * __expf(m_run[r] - m_new) + sum;
                m_run[r] = m_new;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = i0 + warp * 16 + g + 8 * r;
        if (t == 0 && row < a.T) {
            a.lse[(int64_t) h * a.T + row] = l_run[r] > 0.f ? m_run[r] + __logf(l_run[r]) : INFINITY;   // +inf: P = 0
        }
    }
}

// dK, dV for one key tile of one q head (atomically added over the group's q
// heads), dQ added atomically over key tiles. Each warp owns 16 of the 64 keys:
// S^T, P^T, dP^T and dS^T of its rows against a query tile stay in registers;
// dS^T goes to shared memory once, for dQ, whose rows the warps then split.
// One query tile's inputs to shared memory: the mask (mixed tiles), Q, dO times
// sg, lse_i and sg * D_i; rows past T read as lse = +inf (P = 0) and D = 0.
template <int D> __device__ __forceinline__ void fa_main_load_queries(const fa_args & a, half * qs, half * gs, half * ms,
                                                                      float * lse, float * dvs, uint8_t c, int i0,
                                                                      int j0, int h, float sg) {
    if (c == TILE_MIXED) {
        load_mask(ms, a, i0, j0);
    }
    load_rows_f32<D>(qs, a.q + h * a.q_head, a.q_row, i0, a.T, a.q_vec, 1.f);
    load_rows_f32<D>(gs, a.d_o + (int64_t) h * D, (int64_t) a.H * D, i0, a.T, true, sg);
    for (int r = threadIdx.x; r < 64; r += THREADS) {
        const bool in = i0 + r < a.T;
        lse[r] = in ? a.lse[(int64_t) h * a.T + i0 + r] : INFINITY;
        dvs[r] = in ? sg * a.dvec[(int64_t) h * a.T + i0 + r] : 0.f;
    }
}

// P^T in place of this warp's scores S^T (16 keys x 64 queries): exp(scale S + mask - lse).
__device__ __forceinline__ void fa_main_probs(float (&p)[8][4], const fa_args & a, const half * ms, const float * lse,
                                              uint8_t c, int warp, int g, int t) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int qi = 8 * j + 2 * t + e % 2, kr = warp * 16 + g + 8 * (e / 2);
            float x = a.scale * p[j][e];
            if (c == TILE_MIXED) {
                x += __half2float(ms[qi * LDT + kr]);
            }
            p[j][e] = x == -INFINITY ? 0.f : __expf(x - lse[qi]);
        }
    }
}

// dS^T = P^T (dP^T - D) in place over P^T, and this warp's 16 rows of it to shared memory (for dQ).
__device__ __forceinline__ void fa_main_dscores(float (&p)[8][4], const float (&dp)[8][4], const float * dvs,
                                                half * dss, int warp, int g, int t) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            p[j][e] *= dp[j][e] - dvs[8 * j + 2 * t + e % 2];
        }
        *(uint32_t *) (dss + (warp * 16 + g) * LDT + 8 * j + 2 * t) = pack(p[j][0], p[j][1]);
        *(uint32_t *) (dss + (warp * 16 + g + 8) * LDT + 8 * j + 2 * t) = pack(p[j][2], p[j][3]);
    }
}

// dQ rows [i0 + 16 warp, +16) += dS K, 64 columns at a time, added to global memory.
template <int D> __device__ __forceinline__ void fa_main_add_dq(const fa_args & a, const half * dss, const half * ks,
                                                                int h, int i0, int warp, float sg) {
    constexpr int LH = ldh<D>();
#pragma unroll
    for (int dc = 0; dc < D / 64; ++dc) {
        float dq[8][4] = {};
#pragma unroll
        for (int kk = 0; kk < 4; ++kk) {
            uint32_t af[4];
            frag_a_t(af, dss + kk * 16 * LDT + warp * 16, LDT);   // dS[q][k] = dS^T[k][q]
#pragma unroll
            for (int np = 0; np < 4; ++np) {
                uint32_t bf[4];
                frag_b2_t(bf, ks + kk * 16 * LH + dc * 64 + np * 16, LH);
                mma(dq[2 * np], af, bf[0], bf[1]);
                mma(dq[2 * np + 1], af, bf[2], bf[3]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            add_tile(a.dq + (int64_t) h * a.dq_head + dc * 64 + 8 * j, a.dq_row, dq[j], a.scale / sg, i0 + warp * 16,
                     a.T);
        }
    }
}

template <int D> __global__ void __launch_bounds__(THREADS, D == 64 ? 3 : 2) fa_back_main(fa_args a) {
    constexpr int LH = ldh<D>();
    constexpr int NT = D / 8;                   // 8-column accumulator tiles across D
    extern __shared__ __align__(16) unsigned char smem_raw[];
    half * ks  = (half *) smem_raw;             // [64][LH] this block's keys
    half * vs  = ks + 64 * LH;                  // [64][LH] and values
    half * qs  = vs + 64 * LH;                  // [64][LH] the query tile
    half * gs  = qs + 64 * LH;                  // [64][LH] its dO, times the head's scale
    half * dss = gs + 64 * LH;                  // [64 keys][LDT] dS^T
    half * ms  = dss + 64 * LDT;                // [64 queries][LDT] the mask, TILE_MIXED tiles only
    float * lse = (float *) (ms + 64 * LDT);    // [64]
    float * dvs = lse + 64;                     // [64] D_i, times the head's scale
    // the first key tiles first: under a causal mask every query sees them
    const int jb = blockIdx.y, j0 = jb * BC, h = blockIdx.x, grp = h / (a.H / a.Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
    const float sg = do_scale(a, h);
    load_rows_f16<D>(ks, a.k + grp * a.k_head, a.k_row, j0, a.Tk, a.kv_vec);
    load_rows_f16<D>(vs, a.v + grp * a.v_head, a.v_row, j0, a.Tk, a.kv_vec);
    float dk[NT][4] = {}, dv[NT][4] = {};
    const int nk = n_kblocks(a);
    const half * kw = ks + warp * 16 * LH;      // this warp's keys
    for (int i0 = 0, ib = 0; i0 < a.T; i0 += BR, ++ib) {
        const uint8_t c = a.cls[ib * nk + jb];
        if (c == TILE_EMPTY) {
            continue;
        }
        __syncthreads();                        // the last tile is consumed
        fa_main_load_queries<D>(a, qs, gs, ms, lse, dvs, c, i0, j0, h, sg);
        __syncthreads();
        float p[8][4] = {};
        mm_abt<D>(p, kw, LH, qs, LH);           // S^T = K Q^T for this warp's 16 keys x 64 queries
        fa_main_probs(p, a, ms, lse, c, warp, g, t);
        mm_xb<NT>(dv, p, gs, LH);               // dV += P^T dO
        float dp[8][4] = {};
        mm_abt<D>(dp, vs + warp * 16 * LH, LH, gs, LH);   // dP^T = V dO^T
        fa_main_dscores(p, dp, dvs, dss, warp, g, t);
        mm_xb<NT>(dk, p, qs, LH);               // dK += dS^T Q
        __syncthreads();                        // every warp's rows of dS^T are in place
        fa_main_add_dq<D>(a, dss, ks, h, i0, warp, sg);
    }
    // this q head's part of dK (scaled) and dV for the block's keys
#pragma unroll
    for (int j = 0; j < NT; ++j) {
        add_tile(a.dk + (int64_t) grp * a.dkv_head + 8 * j, a.dkv_row, dk[j], a.scale / sg, j0 + warp * 16, a.Tk);
        add_tile(a.dv + (int64_t) grp * a.dkv_head + 8 * j, a.dkv_row, dv[j], 1.f / sg, j0 + warp * 16, a.Tk);
    }
}

template <int D> size_t smem_lse() {
    return (size_t) (2 * 64 * ldh<D>() + 64 * LDT) * sizeof(half);
}

template <int D> size_t smem_main() {
    return (size_t) (4 * 64 * ldh<D>() + 2 * 64 * LDT) * sizeof(half) + 2 * 64 * sizeof(float);
}

template <int D> bool launch(const fa_args & a, cudaStream_t stream) {
    static bool attrs[64] = {};   // per device: the shared-memory opt-in is a device's attribute
    int dev = 0;
    if (cudaGetDevice(&dev) != cudaSuccess || dev < 0 || dev >= 64) {
        return false;
    }
    if (!attrs[dev]) {
        if (cudaFuncSetAttribute(fa_back_lse<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_lse<D>()) !=
                cudaSuccess ||
            cudaFuncSetAttribute(fa_back_main<D>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int) smem_main<D>()) !=
                cudaSuccess) {
            return false;
        }
        attrs[dev] = true;
    }
    // each output is zeroed over its extent (its strides cover a dense block: checked by the caller)
    cudaMemsetAsync(a.dq, 0, sizeof(float) * (size_t) D * a.T * a.H, stream);
    cudaMemsetAsync(a.dk, 0, sizeof(float) * (size_t) D * a.Tk * a.Hk, stream);
    cudaMemsetAsync(a.dv, 0, sizeof(float) * (size_t) D * a.Tk * a.Hk, stream);
    cudaMemsetAsync(a.amax, 0, sizeof(uint32_t) * (size_t) a.H, stream);
    const dim3 tiles((a.T + BR - 1) / BR, (a.Tk + BC - 1) / BC);
    fa_back_classify<<<tiles, THREADS, 0, stream>>>(a);
    fa_back_dvec<D><<<dim3(a.H, (a.T + 63) / 64), THREADS, 0, stream>>>(a);
    fa_back_lse<D><<<dim3(a.H, (a.T + BR - 1) / BR), THREADS, smem_lse<D>(), stream>>>(a);
    fa_back_main<D><<<dim3(a.H, (a.Tk + BC - 1) / BC), THREADS, smem_main<D>(), stream>>>(a);
    return cudaGetLastError() == cudaSuccess;
}

}  // namespace
// What the kernels take, in plain pointers (strides in elements of each tensor's type).
struct dream_fa_back_params {
    const float * q; int64_t q_row, q_head;
    const void  * k; int64_t k_row, k_head;     // F16
    const void  * v; int64_t v_row, v_head;     // F16
    const void  * mask; int64_t mask_row;       // F16 or nullptr
    const float * o; const float * d_o;         // [D, H, T] contiguous
    float * dq; float * dk; float * dv;         // outputs
    int64_t dq_row, dq_head, dkv_row, dkv_head; // their strides in floats: [D, T, H] or [D, H, T] blocks
    float * lse; float * dvec;                  // [H, T] each
    uint8_t * cls;                              // ceil(T / 64) x ceil(Tk / 64) bytes
    uint32_t * amax;                            // n_head words
    float scale;
    int64_t head_dim, n_tokens, n_kv, n_head, n_head_kv;
};

bool dream_cuda_fa_back_supported(int64_t head_dim, int64_t n_head, int64_t n_head_kv) {
    return (head_dim == 64 || head_dim == 128) && n_head_kv > 0 && n_head % n_head_kv == 0;
}

bool dream_cuda_fa_back(const dream_fa_back_params & p, cudaStream_t stream) {
    if (!dream_cuda_fa_back_supported(p.head_dim, p.n_head, p.n_head_kv)) {
        return false;
    }
    fa_args a;
    a.q = p.q;       a.q_row = p.q_row;       a.q_head = p.q_head;
    a.k = (const half *) p.k;  a.k_row = p.k_row;  a.k_head = p.k_head;
    a.v = (const half *) p.v;  a.v_row = p.v_row;  a.v_head = p.v_head;
    a.mask = (const half *) p.mask;  a.mask_row = p.mask_row;
    a.o = p.o;  a.d_o = p.d_o;
    a.dq = p.dq;  a.dk = p.dk;  a.dv = p.dv;  a.lse = p.lse;  a.dvec = p.dvec;  a.cls = p.cls;
    a.dq_row = p.dq_row;  a.dq_head = p.dq_head;  a.dkv_row = p.dkv_row;  a.dkv_head = p.dkv_head;
    a.amax = p.amax;
    auto al16 = [](const void * x) { return ((uintptr_t) x) % 16 == 0; };
    a.q_vec = p.q_row % 4 == 0 && p.q_head % 4 == 0 && al16(p.q);
    a.kv_vec = p.k_row % 8 == 0 && p.k_head % 8 == 0 && p.v_row % 8 == 0 && p.v_head % 8 == 0 && al16(p.k) && al16(p.v);
    if (!al16(p.d_o)) {
        return false;                           // dO is read 16 bytes at a time (ggml allocations are aligned)
    }
    // the outputs: dense blocks, head-major or token-major, rows of 16-byte multiples
    const int64_t D = p.head_dim;
    const bool dq_ok = (p.dq_row == D && p.dq_head == D * p.n_tokens) || (p.dq_head == D && p.dq_row == D * p.n_head);
    const bool dkv_ok = (p.dkv_row == D && p.dkv_head == D * p.n_kv) || (p.dkv_head == D && p.dkv_row == D * p.n_head_kv);
    if (!dq_ok || !dkv_ok || !al16(p.dq) || !al16(p.dk) || !al16(p.dv)) {
        return false;
    }
    a.scale = p.scale;
    a.T = (int) p.n_tokens;  a.Tk = (int) p.n_kv;  a.H = (int) p.n_head;  a.Hk = (int) p.n_head_kv;
    return p.head_dim == 64 ? launch<64>(a, stream) : launch<128>(a, stream);
}

#ifndef DREAM_FA_NO_GGML
// GGML_OP_FLASH_ATTN_BACK as dream-fattn.cpp builds it (dQ token-major, dK and dV head-major): src q (F32 [D, T, H]),
// k, v (F16 [D, Tk, Hk]), mask (F16 [Tk, >= T] or none), O and dO (F32 [D, H, T],
// contiguous); op params: scale, then the offsets (floats) of dK, dV, lse, D and
// the tile classes in dst, whose first part is dQ; the tile classes' bytes, rounded up to whole floats, are
// followed by one word per q head (dO's largest magnitude). Anything else is not
// this op's layout.
static bool dream_fa_back_layout(const ggml_tensor * op, dream_fa_back_params & p) {
    const ggml_tensor * q = op->src[0], * k = op->src[1], * v = op->src[2], * m = op->src[3];
    const ggml_tensor * o = op->src[4], * g = op->src[5];
    if (!q || !k || !v || !o || !g || op->type != GGML_TYPE_F32 || q->type != GGML_TYPE_F32 ||
        k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16 || o->type != GGML_TYPE_F32 || g->type != GGML_TYPE_F32 ||
        (m && m->type != GGML_TYPE_F16)) {
        return false;
    }
    const int64_t D = q->ne[0], T = q->ne[1], H = q->ne[2], Tk = k->ne[1], Hk = k->ne[2];
    if (q->ne[3] != 1 || k->ne[0] != D || v->ne[0] != D || v->ne[1] != Tk || v->ne[2] != Hk || k->ne[3] != 1 ||
        v->ne[3] != 1 || q->nb[0] != sizeof(float) || k->nb[0] != sizeof(half) || v->nb[0] != sizeof(half) ||
        !ggml_is_contiguous(o) || !ggml_is_contiguous(g) || o->ne[0] != D || o->ne[1] != H || o->ne[2] != T ||
        !ggml_are_same_shape(o, g) || (m && (m->ne[0] != Tk || m->ne[1] < T || m->ne[2] != 1 || m->ne[3] != 1 ||
                                             m->nb[0] != sizeof(half)))) {
        return false;
    }
    const int32_t * off = (const int32_t *) op->op_params + 1;
    const int64_t n_cls = ((T + 63) / 64) * ((Tk + 63) / 64);
    const int64_t need = std::max({ (int64_t) off[0] + D * Tk * Hk, (int64_t) off[1] + D * Tk * Hk,
                                    (int64_t) off[2] + T * H, (int64_t) off[3] + T * H, (int64_t) off[4] + (n_cls + 3) / 4 + H });
    if (off[0] < D * T * H || ggml_nelements(op) < need) {
        return false;
    }
    std::memcpy(&p.scale, op->op_params, sizeof(float));
    p.q_row = q->nb[1] / sizeof(float);  p.q_head = q->nb[2] / sizeof(float);
    p.k_row = k->nb[1] / sizeof(half);   p.k_head = k->nb[2] / sizeof(half);
    p.v_row = v->nb[1] / sizeof(half);   p.v_head = v->nb[2] / sizeof(half);
    p.mask_row = m ? m->nb[1] / sizeof(half) : 0;
    p.head_dim = D; p.n_tokens = T; p.n_kv = Tk; p.n_head = H; p.n_head_kv = Hk;
    p.q = (const float *) q->data; p.k = k->data; p.v = v->data; p.mask = m ? m->data : nullptr;
    p.o = (const float *) o->data; p.d_o = (const float *) g->data;
    float * dst = (float *) op->data;
    p.dq = dst; p.dk = dst + off[0]; p.dv = dst + off[1]; p.lse = dst + off[2]; p.dvec = dst + off[3];
    p.dq_row = D * H; p.dq_head = D; p.dkv_row = D; p.dkv_head = D * Tk;   // dQ token-major, dK and dV head-major
    p.cls = (uint8_t *) (dst + off[4]);
    p.amax = (uint32_t *) (dst + off[4] + (n_cls + 3) / 4);
    return dream_cuda_fa_back_supported(D, H, Hk) && T > 0 && Tk > 0;
}

bool dream_cuda_fa_back_supports(const ggml_tensor * op) {
    dream_fa_back_params p;
    return dream_fa_back_layout(op, p);
}

void dream_cuda_fa_back_op(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    dream_fa_back_params p;
    GGML_ASSERT(dream_fa_back_layout(dst, p) && "FLASH_ATTN_BACK: not the layout dream-fattn.cpp builds");
    GGML_ASSERT(dream_cuda_fa_back(p, ctx.stream()));
}
#endif
