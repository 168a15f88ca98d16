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
// Products run on tensor cores in TF32 with F32 accumulation (what cuBLAS does
// for the explicit path's F32 products by default); everything else is F32.
// Layouts are ggml's: Q [D, T, H] (any strides), K and V [D, Tk, Hk] F16
// (any row and head strides), mask [Tk, >= T] F16 (one for every head), O and
// dO [D, H, T] contiguous F32. Grouped-query heads: q head h reads kv head
// h / (H / Hk). Outputs, contiguous F32: dQ [D, T, H], dK and dV [D, Tk, Hk].
#ifndef DREAM_FA_NO_GGML
#include "out-prod.cuh"
#endif

#include <cuda_fp16.h>
#include <mma.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

using namespace nvcuda;

namespace {

constexpr int BR = 64;      // rows of a query tile
constexpr int BC = 64;      // rows of a key tile
constexpr int WARPS = 4;    // a block: each warp owns 16 rows of the tile it iterates over
constexpr int THREADS = 32 * WARPS;
constexpr int LDS = BC + 4; // row stride (floats) of the score tiles in shared memory
constexpr int LDM = BC + 8; // row stride (halves) of the mask tile

using frag_a_row = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using frag_a_col = wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using frag_b_row = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::row_major>;
using frag_b_col = wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major>;
using frag_acc = wmma::fragment<wmma::accumulator, 16, 16, 8, float>;

// Every operand is rounded to TF32 once, where it is written to shared memory,
// so fragments load ready to multiply (a conversion per fragment load was most
// of the instructions: measured on the H200, 2026-12-01).
__device__ __forceinline__ float tf32(float x) {
    return wmma::__float_to_tf32(x);
}

// acc[n] = A B^T for one warp: A is 16 rows of K values (ld la), B is 64 rows
// of K values (ld lb); acc[n] holds columns [16 n, 16 n + 16)
template <int K> __device__ __forceinline__ void mm_abt(frag_acc (&acc)[4], const float * a, int la, const float * b, int lb) {
#pragma unroll
    for (int n = 0; n < 4; ++n) {
        wmma::fill_fragment(acc[n], 0.f);
    }
#pragma unroll
    for (int kk = 0; kk < K; kk += 8) {
        frag_a_row fa;
        wmma::load_matrix_sync(fa, a + kk, la);
#pragma unroll
        for (int n = 0; n < 4; ++n) {
            frag_b_col fb;
            wmma::load_matrix_sync(fb, b + n * 16 * lb + kk, lb);
            wmma::mma_sync(acc[n], fa, fb, acc[n]);
        }
    }
}

// acc[n] += A B for one warp: A is 16 x 64 (row-major at a with ld la, or, with
// A_COL, the transpose of a 64 x 16 block: a[k * la + r]), B is 64 rows of
// 16 ND values (ld lb)
template <int ND, bool A_COL> __device__ __forceinline__ void mm_ab(frag_acc (&acc)[ND], const float * a, int la,
                                                                   const float * b, int lb) {
    using frag_a = typename std::conditional<A_COL, frag_a_col, frag_a_row>::type;
#pragma unroll
    for (int kk = 0; kk < 64; kk += 8) {
        frag_a fa;
        wmma::load_matrix_sync(fa, A_COL ? a + kk * la : a + kk, la);
#pragma unroll
        for (int n = 0; n < ND; ++n) {
            frag_b_row fb;
            wmma::load_matrix_sync(fb, b + kk * lb + n * 16, lb);
            wmma::mma_sync(acc[n], fa, fb, acc[n]);
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

template <int N> __device__ __forceinline__ void store_row(float * dst, int ld, const frag_acc (&acc)[N], int n0) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
        wmma::store_matrix_sync(dst + m * 16, acc[n0 + m], ld, wmma::mem_row_major);
    }
}

struct fa_args {
    const float * q;  int64_t q_row, q_head;            // strides in floats
    const half  * k;  int64_t k_row, k_head;            // strides in halves
    const half  * v;  int64_t v_row, v_head;
    const half  * mask; int64_t mask_row;               // nullptr: no mask
    const float * o;  const float * d_o;                // [D, H, T] contiguous
    float * dq; float * dk; float * dv;                  // outputs (zeroed before the main kernel)
    float * lse; float * dvec;                          // [H, T] scratch
    uint8_t * cls;                                      // [T / 64][Tk / 64] tile classes (TILE_*)
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

// rows [r0, r0 + 64) of a [*, D] F32 matrix with row stride `row` into shared (ld D + 4); zeros past n
template <int D> __device__ __forceinline__ void load_rows_f32(float * dst, const float * src, int64_t row, int r0, int n,
                                                               bool vec) {
    constexpr int LD = D + 4;
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
        *(float4 *) (dst + r * LD + c) = make_float4(tf32(x.x), tf32(x.y), tf32(x.z), tf32(x.w));
    }
}

template <int D> __device__ __forceinline__ void load_rows_f16(float * dst, const half * src, int64_t row, int r0, int n,
                                                               bool vec) {
    constexpr int LD = D + 4;
    constexpr int PER = 64 * (D / 8) / THREADS;
#pragma unroll
    for (int it = 0; it < PER; ++it) {
        const int e = threadIdx.x + it * THREADS;
        const int r = e / (D / 8), c = (e % (D / 8)) * 8;
        half2 h[4] = { __float2half2_rn(0.f), __float2half2_rn(0.f), __float2half2_rn(0.f), __float2half2_rn(0.f) };
        if (r0 + r < n) {
            const half * p = src + (int64_t) (r0 + r) * row + c;
            if (vec) {
                const uint4 u = __ldg((const uint4 *) p);
                std::memcpy(h, &u, sizeof(u));
            } else {
#pragma unroll
                for (int k = 0; k < 4; ++k) {
                    h[k] = __halves2half2(p[2 * k], p[2 * k + 1]);
                }
            }
        }
        float * o = dst + r * LD + c;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const float2 f = __half22float2(h[k]);   // an F16 value is a TF32 value already
            o[2 * k] = f.x;
            o[2 * k + 1] = f.y;
        }
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
        dst[i * LDM + j] = m;
    }
}

// D_i = dO_i . O_i, one warp per (t, h)
template <int D> __global__ void fa_back_dvec(fa_args a) {
    const int w = blockIdx.x * WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (w >= a.T * a.H) {
        return;
    }
    const int t = w / a.H, h = w % a.H;
    const float * o = a.o + ((int64_t) t * a.H + h) * D;
    const float * g = a.d_o + ((int64_t) t * a.H + h) * D;
    float s = 0.f;
    for (int d = lane; d < D; d += 32) {
        s += o[d] * g[d];
    }
    for (int off = 16; off > 0; off >>= 1) {
        s += __shfl_xor_sync(0xffffffff, s, off);
    }
    if (lane == 0) {
        a.dvec[(int64_t) h * a.T + t] = s;
    }
}

// lse_i for a tile of 64 queries of one head: the scores again, key tile by key tile
template <int D> __global__ void __launch_bounds__(THREADS) fa_back_lse(fa_args a) {
    constexpr int LD = D + 4;
    extern __shared__ __align__(32) unsigned char smem_raw[];
    float * qs = (float *) smem_raw;            // [64][LD]
    float * ks = qs + 64 * LD;                  // [64][LD]
    float * ss = ks + 64 * LD;                  // [64][LDS]
    half  * ms = (half *) (ss + 64 * LDS);      // [64][LDM]
    // the last query tiles first: under a causal mask they see the most keys (the
    // longest blocks start first, so the last wave is short)
    const int ib = gridDim.y - 1 - blockIdx.y, i0 = ib * BR, h = blockIdx.x, g = h / (a.H / a.Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_rows_f32<D>(qs, a.q + h * a.q_head, a.q_row, i0, a.T, a.q_vec);
    // each lane pair keeps the running max and sum of one row (lane / 2) of its warp's 16
    float m_run = -INFINITY, l_run = 0.f;
    const int row = warp * 16 + lane / 2, half_cols = (lane % 2) * 32;
    const uint8_t * cls = a.cls + ib * n_kblocks(a);
    for (int jb = 0; jb < n_kblocks(a); ++jb) {
        const uint8_t c = cls[jb];
        if (c == TILE_EMPTY) {
            continue;
        }
        const int j0 = jb * BC;
        __syncthreads();                        // the tiles of the last round are read
        if (c == TILE_MIXED) {
            load_mask(ms, a, i0, j0);
        }
        load_rows_f16<D>(ks, a.k + g * a.k_head, a.k_row, j0, a.Tk, a.kv_vec);
        __syncthreads();
        frag_acc acc[4];
        mm_abt<D>(acc, qs + warp * 16 * LD, LD, ks, LD);
        store_row(ss + warp * 16 * LDS, LDS, acc, 0);
        __syncwarp();
        float x[32];
        float mx = -INFINITY;
#pragma unroll
        for (int k = 0; k < 32; ++k) {
            x[k] = a.scale * ss[row * LDS + half_cols + k];
            if (c == TILE_MIXED) {
                x[k] += __half2float(ms[row * LDM + half_cols + k]);
            }
            mx = fmaxf(mx, x[k]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        const float m_new = fmaxf(m_run, mx);
        float s = 0.f;
        if (m_new != -INFINITY) {               // else the row has seen no key yet
#pragma unroll
            for (int k = 0; k < 32; ++k) {
                s += __expf(x[k] - m_new);
            }
        }
        s += __shfl_xor_sync(0xffffffff, s, 1);
        if (m_new != -INFINITY) {
            l_run = l_run * __expf(m_run - m_new) + s;
            m_run = m_new;
        }
    }
    if (lane % 2 == 0 && i0 + row < a.T) {
        a.lse[(int64_t) h * a.T + i0 + row] = l_run > 0.f ? m_run + __logf(l_run) : INFINITY;   // +inf: P = 0
    }
}

// dK, dV for one key tile of one q head (atomically added over the group's q
// heads), dQ added atomically over key tiles
template <int D> __global__ void __launch_bounds__(THREADS, D == 64 ? 2 : 1) fa_back_main(fa_args a) {
    constexpr int LD = D + 4;
    constexpr int ND = D / 16;                  // 16-column tiles across D
    extern __shared__ __align__(32) unsigned char smem_raw[];
    float * ks  = (float *) smem_raw;           // [64][LD] this block's keys
    float * vs  = ks + 64 * LD;                 // [64][LD] and values
    float * qs  = vs + 64 * LD;                 // [64][LD] the query tile
    float * gs  = qs + 64 * LD;                 // [64][LD] its dO
    float * ps  = gs + 64 * LD;                 // [64 keys][LDS] P^T, then dS^T
    float * dps = ps + 64 * LDS;                // [64][LDS] the mask tile (as halves), dP^T, then dQ staging
    float * lse = dps + 64 * LDS;               // [64]
    float * dv  = lse + 64;                     // [64]
    half  * ms  = (half *) dps;                 // [64 queries][LDM], TILE_MIXED tiles only
    // the first key tiles first: under a causal mask every query sees them
    const int jb = blockIdx.y, j0 = jb * BC, h = blockIdx.x, g = h / (a.H / a.Hk);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    load_rows_f16<D>(ks, a.k + g * a.k_head, a.k_row, j0, a.Tk, a.kv_vec);
    load_rows_f16<D>(vs, a.v + g * a.v_head, a.v_row, j0, a.Tk, a.kv_vec);
    frag_acc dk_acc[ND], dv_acc[ND];
#pragma unroll
    for (int n = 0; n < ND; ++n) {
        wmma::fill_fragment(dk_acc[n], 0.f);
        wmma::fill_fragment(dv_acc[n], 0.f);
    }
    const int nk = n_kblocks(a);
    for (int i0 = 0, ib = 0; i0 < a.T; i0 += BR, ++ib) {
        const uint8_t c = a.cls[ib * nk + jb];
        if (c == TILE_EMPTY) {
            continue;
        }
        __syncthreads();                        // the last tile is consumed
        if (c == TILE_MIXED) {
            load_mask(ms, a, i0, j0);
        }
        load_rows_f32<D>(qs, a.q + h * a.q_head, a.q_row, i0, a.T, a.q_vec);
        load_rows_f32<D>(gs, a.d_o + (int64_t) h * D, (int64_t) a.H * D, i0, a.T, true);
        for (int r = threadIdx.x; r < 64; r += THREADS) {
            const bool in = i0 + r < a.T;
            lse[r] = in ? a.lse[(int64_t) h * a.T + i0 + r] : INFINITY;
            dv[r] = in ? a.dvec[(int64_t) h * a.T + i0 + r] : 0.f;
        }
        __syncthreads();
        // S^T for this warp's 16 keys x 64 queries, then P^T
        frag_acc acc[4];
        mm_abt<D>(acc, ks + warp * 16 * LD, LD, qs, LD);
        store_row(ps + warp * 16 * LDS, LDS, acc, 0);
        __syncwarp();
        if (c == TILE_MIXED) {
            for (int e = lane; e < 16 * 64; e += 32) {
                const int kr = warp * 16 + e / 64, qi = e % 64;
                const float s = a.scale * ps[kr * LDS + qi] + __half2float(ms[qi * LDM + kr]);
                ps[kr * LDS + qi] = s == -INFINITY ? 0.f : tf32(__expf(s - lse[qi]));
            }
            __syncthreads();                    // every warp has read the mask before dP^T overwrites it
        } else {
            for (int e = lane; e < 16 * 16; e += 32) {   // four queries a lane, 16 bytes at a time
                const int kr = warp * 16 + e / 16, qi = (e % 16) * 4;
                float4 x = *(float4 *) (ps + kr * LDS + qi);
                x.x = tf32(__expf(a.scale * x.x - lse[qi]));
                x.y = tf32(__expf(a.scale * x.y - lse[qi + 1]));
                x.z = tf32(__expf(a.scale * x.z - lse[qi + 2]));
                x.w = tf32(__expf(a.scale * x.w - lse[qi + 3]));
                *(float4 *) (ps + kr * LDS + qi) = x;
            }
            __syncwarp();
        }
        mm_ab<ND, false>(dv_acc, ps + warp * 16 * LDS, LDS, gs, LD);          // dV += P^T dO
        mm_abt<D>(acc, vs + warp * 16 * LD, LD, gs, LD);                      // dP^T = V dO^T, this warp's keys
        store_row(dps + warp * 16 * LDS, LDS, acc, 0);
        __syncwarp();
        // dS^T = P^T (dP^T - D), over P^T
        for (int e = lane; e < 16 * 16; e += 32) {
            const int kr = warp * 16 + e / 16, qi = (e % 16) * 4;
            float4 x = *(float4 *) (ps + kr * LDS + qi);
            const float4 y = *(const float4 *) (dps + kr * LDS + qi);
            x.x = tf32(x.x * (y.x - dv[qi]));
            x.y = tf32(x.y * (y.y - dv[qi + 1]));
            x.z = tf32(x.z * (y.z - dv[qi + 2]));
            x.w = tf32(x.w * (y.w - dv[qi + 3]));
            *(float4 *) (ps + kr * LDS + qi) = x;
        }
        __syncwarp();
        mm_ab<ND, false>(dk_acc, ps + warp * 16 * LDS, LDS, qs, LD);          // dK += dS^T Q
        __syncthreads();                        // every warp's rows of dS^T are in place
        // dQ rows [16 warp, +16) = dS K, added to global
        {
            frag_acc dq[ND];
#pragma unroll
            for (int n = 0; n < ND; ++n) {
                wmma::fill_fragment(dq[n], 0.f);
            }
            mm_ab<ND, true>(dq, ps + warp * 16, LDS, ks, LD);   // dS[q][k] = dS^T[k][q]: column-major over ps
            // staged per warp in dps (dP^T is spent), 16 rows x 64 columns at a time, then added
            float * st = dps + warp * 16 * LDS;
#pragma unroll
            for (int n = 0; n < ND; n += 4) {
                store_row(st, LDS, dq, n);
                __syncwarp();
                for (int e = lane; e < 16 * 16; e += 32) {   // four columns a lane
                    const int r = e / 16, cc = (e % 16) * 4;
                    const int t = i0 + warp * 16 + r;
                    if (t < a.T) {
                        add4(a.dq + ((int64_t) h * a.T + t) * D + n * 16 + cc, *(const float4 *) (st + r * LDS + cc), a.scale);
                    }
                }
                __syncwarp();
            }
        }
    }
    __syncthreads();
    // this q head's part of dK (scaled) and dV for the block's keys
    float * st = ps + warp * 16 * LDS;          // 16 x 64 staging per warp (ps and dps are spent)
#pragma unroll
    for (int which = 0; which < 2; ++which) {
        float * out = which == 0 ? a.dk : a.dv;
#pragma unroll
        for (int n = 0; n < ND; n += 4) {
            if (which == 0) {
                store_row(st, LDS, dk_acc, n);
            } else {
                store_row(st, LDS, dv_acc, n);
            }
            __syncwarp();
            for (int e = lane; e < 16 * 16; e += 32) {
                const int r = e / 16, cc = (e % 16) * 4;
                const int j = j0 + warp * 16 + r;
                if (j < a.Tk) {
                    add4(out + ((int64_t) g * a.Tk + j) * D + n * 16 + cc, *(const float4 *) (st + r * LDS + cc),
                         which == 0 ? a.scale : 1.f);
                }
            }
            __syncwarp();
        }
    }
}

template <int D> size_t smem_lse() {
    return (size_t) (2 * 64 * (D + 4) + 64 * LDS) * sizeof(float) + (size_t) 64 * LDM * sizeof(half);
}

template <int D> size_t smem_main() {
    static_assert(64 * LDM * sizeof(half) <= 64 * LDS * sizeof(float), "the mask tile fits where dP^T goes");
    return (size_t) (4 * 64 * (D + 4) + 2 * 64 * LDS + 2 * 64) * sizeof(float);
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
    cudaMemsetAsync(a.dq, 0, sizeof(float) * (size_t) D * a.T * a.H, stream);
    cudaMemsetAsync(a.dk, 0, sizeof(float) * (size_t) D * a.Tk * a.Hk, stream);
    cudaMemsetAsync(a.dv, 0, sizeof(float) * (size_t) D * a.Tk * a.Hk, stream);
    const dim3 tiles((a.T + BR - 1) / BR, (a.Tk + BC - 1) / BC);
    fa_back_classify<<<tiles, THREADS, 0, stream>>>(a);
    fa_back_dvec<D><<<(a.T * a.H + WARPS - 1) / WARPS, THREADS, 0, stream>>>(a);
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
    float * dq; float * dk; float * dv;         // contiguous outputs
    float * lse; float * dvec;                  // [H, T] each
    uint8_t * cls;                              // ceil(T / 64) x ceil(Tk / 64) bytes
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
    auto al16 = [](const void * x) { return ((uintptr_t) x) % 16 == 0; };
    a.q_vec = p.q_row % 4 == 0 && p.q_head % 4 == 0 && al16(p.q);
    a.kv_vec = p.k_row % 8 == 0 && p.k_head % 8 == 0 && p.v_row % 8 == 0 && p.v_head % 8 == 0 && al16(p.k) && al16(p.v);
    if (!al16(p.d_o)) {
        return false;                           // dO is read 16 bytes at a time (ggml allocations are aligned)
    }
    a.scale = p.scale;
    a.T = (int) p.n_tokens;  a.Tk = (int) p.n_kv;  a.H = (int) p.n_head;  a.Hk = (int) p.n_head_kv;
    return p.head_dim == 64 ? launch<64>(a, stream) : launch<128>(a, stream);
}

#ifndef DREAM_FA_NO_GGML
// GGML_OP_FLASH_ATTN_BACK as dream-fattn.cpp builds it: src q (F32 [D, T, H]),
// k, v (F16 [D, Tk, Hk]), mask (F16 [Tk, >= T] or none), O and dO (F32 [D, H, T],
// contiguous); op params: scale, then the offsets (floats) of dK, dV, lse, D and
// the tile classes in dst, whose first part is dQ. Anything else is not this op's layout.
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
                                    (int64_t) off[2] + T * H, (int64_t) off[3] + T * H, (int64_t) off[4] + (n_cls + 3) / 4 });
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
    p.cls = (uint8_t *) (dst + off[4]);
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
