// The fused attention backward (dreamstage/ggml_ext/cuda/flash-attn-back.cu)
// against the explicit formulas in double on the host, and its time at the
// shapes of a 2048-token step of Llama-3.2-1B (32 heads, 8 kv heads, head 64).
//
//   nvcc -O3 -std=c++17 -arch=sm_90 bench/gpu/dream_fa_check.cu -o /tmp/dream_fa_check
//   /tmp/dream_fa_check            # prints one line per case, PASS/FAIL, then the timing; exit 1 on a FAIL
//
// The reference: O = softmax(scale Q K^T + mask) V, then with a random dO,
// dV = P^T dO, dP = dO V^T, dS = P (dP - rowsum(dO O)), dQ = scale dS K,
// dK = scale dS^T Q, all in double from the same F16 K, V and F32 Q the kernel
// reads. The kernel multiplies F16 operands (10-bit mantissa, as TF32), so it
// is held to a relative L2 of 5e-3 over each whole gradient (measured with the
// TF32 kernel before it: 3e-4 to 5e-4). dO is drawn at 1e-3 and, in one case,
// at 1e-7, below F16's smallest normal number: the kernel must not lose it.
#define DREAM_FA_NO_GGML
#include "../../dreamstage/ggml_ext/cuda/flash-attn-back.cu"

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); std::exit(2); } } while (0)

struct shape { int T, Tk, H, Hk, D; const char * name; float do_scale = 1e-3f; };

static double rel_l2(const std::vector<float> & got, const std::vector<double> & want) {
    double num = 0, den = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        num += (got[i] - want[i]) * (got[i] - want[i]);
        den += want[i] * want[i];
    }
    return den > 0 ? std::sqrt(num / den) : std::sqrt(num);
}

template <typename T> static T * to_dev(const std::vector<T> & h) {
    T * d = nullptr;
    CK(cudaMalloc(&d, h.size() * sizeof(T) + 16));
    CK(cudaMemcpy(d, h.data(), h.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}

// host data of one case: Q as the permuted view of a [D, H, T] tensor, K and V [D, Tk, Hk],
// a causal mask whose queries sit at the last T of Tk positions, O from the reference forward
struct case_data {
    shape s;
    std::vector<float> q, o, d_o;
    std::vector<__half> k, v, mask;
    std::vector<double> dq, dk, dv;
};

static case_data make_case(const shape & s, uint32_t seed, bool reference) {
    case_data c{ s };
    std::mt19937 rng(seed);
    std::normal_distribution<float> nd(0.f, 1.f);
    const int T = s.T, Tk = s.Tk, H = s.H, Hk = s.Hk, D = s.D, G = H / Hk;
    c.q.resize((size_t) D * H * T);
    for (auto & x : c.q) x = nd(rng);
    c.k.resize((size_t) D * Tk * Hk);
    c.v.resize((size_t) D * Tk * Hk);
    for (auto & x : c.k) x = __float2half(nd(rng));
    for (auto & x : c.v) x = __float2half(nd(rng));
    c.mask.resize((size_t) Tk * T);
    for (int i = 0; i < T; ++i)
        for (int j = 0; j < Tk; ++j)
            c.mask[(size_t) i * Tk + j] = __float2half(j <= Tk - T + i ? 0.f : -INFINITY);
    c.d_o.resize((size_t) D * H * T);
    for (auto & x : c.d_o) x = s.do_scale * nd(rng);   // gradients are small; the kernel must not lose them
    c.o.assign((size_t) D * H * T, 0.f);
    if (!reference) {
        for (auto & x : c.o) x = nd(rng);
        return c;
    }
    const double scale = 1.0 / std::sqrt((double) D);
    auto Q = [&](int t, int h, int d) { return (double) c.q[((size_t) t * H + h) * D + d]; };
    auto K = [&](int j, int g, int d) { return (double) __half2float(c.k[((size_t) g * Tk + j) * D + d]); };
    auto V = [&](int j, int g, int d) { return (double) __half2float(c.v[((size_t) g * Tk + j) * D + d]); };
    c.dq.assign((size_t) D * T * H, 0.0);
    c.dk.assign((size_t) D * Tk * Hk, 0.0);
    c.dv.assign((size_t) D * Tk * Hk, 0.0);
    std::vector<double> p(Tk), dp(Tk);
    for (int h = 0; h < H; ++h) {
        const int g = h / G;
        for (int i = 0; i < T; ++i) {
            double mx = -INFINITY;
            for (int j = 0; j < Tk; ++j) {
                const double m = __half2float(c.mask[(size_t) i * Tk + j]);
                double s_ = -INFINITY;
                if (m != -INFINITY) {
                    s_ = 0;
                    for (int d = 0; d < D; ++d) s_ += Q(i, h, d) * K(j, g, d);
                    s_ = scale * s_ + m;
                }
                p[j] = s_;
                mx = std::max(mx, s_);
            }
            double sum = 0;
            for (int j = 0; j < Tk; ++j) { p[j] = p[j] == -INFINITY ? 0.0 : std::exp(p[j] - mx); sum += p[j]; }
            for (int j = 0; j < Tk; ++j) p[j] /= sum;
            std::vector<double> o(D, 0.0);
            for (int j = 0; j < Tk; ++j)
                for (int d = 0; d < D; ++d) o[d] += p[j] * V(j, g, d);
            double di = 0;
            for (int d = 0; d < D; ++d) {
                c.o[((size_t) i * H + h) * D + d] = (float) o[d];
                di += (double) c.d_o[((size_t) i * H + h) * D + d] * (float) o[d];   // as the kernel: from the F32 O
            }
            for (int j = 0; j < Tk; ++j) {
                double x = 0;
                for (int d = 0; d < D; ++d) x += (double) c.d_o[((size_t) i * H + h) * D + d] * V(j, g, d);
                dp[j] = x;
            }
            for (int j = 0; j < Tk; ++j) {
                if (p[j] == 0.0) continue;
                const double ds = p[j] * (dp[j] - di);
                for (int d = 0; d < D; ++d) {
                    c.dv[((size_t) g * Tk + j) * D + d] += p[j] * c.d_o[((size_t) i * H + h) * D + d];
                    c.dq[((size_t) i * H + h) * D + d] += scale * ds * K(j, g, d);
                    c.dk[((size_t) g * Tk + j) * D + d] += scale * ds * Q(i, h, d);
                }
            }
        }
    }
    return c;
}

struct dev_case {
    float *q, *o, *d_o, *dq, *dk, *dv, *lse, *dvec;
    uint8_t * cls;
    uint32_t * amax;
    __half *k, *v, *mask;
    dream_fa_back_params p;
};

static dev_case upload(const case_data & c) {
    const auto & s = c.s;
    dev_case d;
    d.q = to_dev(c.q); d.o = to_dev(c.o); d.d_o = to_dev(c.d_o);
    d.k = to_dev(c.k); d.v = to_dev(c.v); d.mask = to_dev(c.mask);
    CK(cudaMalloc(&d.dq, sizeof(float) * (size_t) s.D * s.T * s.H));
    CK(cudaMalloc(&d.dk, sizeof(float) * (size_t) s.D * s.Tk * s.Hk));
    CK(cudaMalloc(&d.dv, sizeof(float) * (size_t) s.D * s.Tk * s.Hk));
    CK(cudaMalloc(&d.lse, sizeof(float) * (size_t) s.T * s.H));
    CK(cudaMalloc(&d.dvec, sizeof(float) * (size_t) s.T * s.H));
    CK(cudaMalloc(&d.cls, (size_t) ((s.T + 63) / 64) * ((s.Tk + 63) / 64)));
    CK(cudaMalloc(&d.amax, sizeof(uint32_t) * (size_t) s.H));
    auto & p = d.p;
    p.q = d.q; p.q_row = (int64_t) s.H * s.D; p.q_head = s.D;
    p.k = d.k; p.k_row = s.D; p.k_head = (int64_t) s.Tk * s.D;
    p.v = d.v; p.v_row = s.D; p.v_head = (int64_t) s.Tk * s.D;
    p.mask = d.mask; p.mask_row = s.Tk;
    p.o = d.o; p.d_o = d.d_o; p.dq = d.dq; p.dk = d.dk; p.dv = d.dv; p.lse = d.lse; p.dvec = d.dvec; p.cls = d.cls; p.amax = d.amax;
    // dQ token-major, dK and dV head-major, as the ggml op writes them (the reference is laid out so)
    p.dq_row = (int64_t) s.H * s.D; p.dq_head = s.D; p.dkv_row = s.D; p.dkv_head = (int64_t) s.Tk * s.D;
    p.scale = 1.0f / std::sqrt((float) s.D);
    p.head_dim = s.D; p.n_tokens = s.T; p.n_kv = s.Tk; p.n_head = s.H; p.n_head_kv = s.Hk;
    return d;
}

static std::vector<float> down(const float * d, size_t n) {
    std::vector<float> h(n);
    CK(cudaMemcpy(h.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return h;
}

int main() {
    const shape checks[] = {
        { 128, 128, 4, 2, 64, "T 128, heads 4/2, D 64" },
        { 100, 164, 8, 2, 64, "T 100 after a 64-token prefix, heads 8/2, D 64" },
        { 96, 96, 2, 1, 128, "T 96, heads 2/1, D 128" },
        { 256, 256, 32, 8, 64, "T 256, heads 32/8, D 64 (Llama-3.2-1B heads)" },
        { 192, 192, 4, 1, 64, "T 192, heads 4/1, D 64, dO ~ 1e-7", 1e-7f },
        { 130, 130, 4, 4, 128, "T 130, heads 4/4, D 128, dO ~ 1e-7", 1e-7f },
    };
    bool ok = true;
    for (const auto & s : checks) {
        case_data c = make_case(s, 1234 + s.T, true);
        dev_case d = upload(c);
        if (!dream_cuda_fa_back(d.p, 0)) { std::printf("FAIL launch: %s\n", s.name); return 1; }
        CK(cudaDeviceSynchronize());
        const double eq = rel_l2(down(d.dq, c.dq.size()), c.dq);
        const double ek = rel_l2(down(d.dk, c.dk.size()), c.dk);
        const double ev = rel_l2(down(d.dv, c.dv.size()), c.dv);
        const bool pass = eq < 5e-3 && ek < 5e-3 && ev < 5e-3;
        ok = ok && pass;
        std::printf("%s  %-48s rel L2 dQ %.2e dK %.2e dV %.2e\n", pass ? "PASS" : "FAIL", s.name, eq, ek, ev);
    }
    // time: a 2048-token chunk of Llama-3.2-1B, one layer
    for (int T : { 512, 2048 }) {
        const shape s{ T, T, 32, 8, 64, "" };
        case_data c = make_case(s, 7, false);
        dev_case d = upload(c);
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
        std::vector<float> ms;
        for (int rep = 0; rep < 12; ++rep) {
            CK(cudaEventRecord(e0));
            dream_cuda_fa_back(d.p, 0);
            CK(cudaEventRecord(e1));
            CK(cudaEventSynchronize(e1));
            float t = 0; CK(cudaEventElapsedTime(&t, e0, e1));
            if (rep >= 2) ms.push_back(t);
        }
        // each kernel alone (the launch order of dream_cuda_fa_back, inputs as left by it)
        {
            fa_args a;
            const auto & p = d.p;
            a.q = p.q; a.q_row = p.q_row; a.q_head = p.q_head; a.k = (const half *) p.k; a.k_row = p.k_row; a.k_head = p.k_head;
            a.v = (const half *) p.v; a.v_row = p.v_row; a.v_head = p.v_head; a.mask = (const half *) p.mask; a.mask_row = p.mask_row;
            a.o = p.o; a.d_o = p.d_o; a.dq = p.dq; a.dk = p.dk; a.dv = p.dv; a.lse = p.lse; a.dvec = p.dvec; a.cls = p.cls; a.amax = p.amax;
            a.dq_row = p.dq_row; a.dq_head = p.dq_head; a.dkv_row = p.dkv_row; a.dkv_head = p.dkv_head;
            a.scale = p.scale; a.T = T; a.Tk = T; a.H = 32; a.Hk = 8; a.q_vec = true; a.kv_vec = true;
            const dim3 tiles((T + 63) / 64, (T + 63) / 64);
            float t[4] = {0, 0, 0, 0};
            for (int rep = 0; rep < 5; ++rep) {
                float x;
                CK(cudaEventRecord(e0)); fa_back_classify<<<tiles, THREADS>>>(a); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&x, e0, e1)); t[0] += x / 5;
                CK(cudaEventRecord(e0)); fa_back_dvec<64><<<dim3(32, (T + 63) / 64), THREADS>>>(a); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&x, e0, e1)); t[1] += x / 5;
                CK(cudaEventRecord(e0)); fa_back_lse<64><<<dim3(32, (T + 63) / 64), THREADS, smem_lse<64>()>>>(a); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&x, e0, e1)); t[2] += x / 5;
                CK(cudaEventRecord(e0)); fa_back_main<64><<<dim3(32, (T + 63) / 64), THREADS, smem_main<64>()>>>(a); CK(cudaEventRecord(e1)); CK(cudaEventSynchronize(e1));
                CK(cudaEventElapsedTime(&x, e0, e1)); t[3] += x / 5;
            }
            std::printf("  kernels, T %d: classify %.3f ms, dvec %.3f, lse %.3f, main %.3f\n", T, t[0], t[1], t[2], t[3]);
        }
        std::sort(ms.begin(), ms.end());
        const double flop = 5.0 * 2.0 * T * (T + 1) / 2.0 * 64 * 32;   // five products over the causal half
        std::printf("time T %d, heads 32/8, D 64: %.3f ms per layer (median of %zu; min %.3f), %.1f TFLOP/s on the causal half\n",
                    T, ms[ms.size() / 2], ms.size(), ms[0], flop / (ms[ms.size() / 2] * 1e-3) / 1e12);
    }
    std::printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
    return ok ? 0 : 1;
}
