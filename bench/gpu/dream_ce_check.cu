// dream_ce_check: the cross-entropy kernels of dreamstage/ggml_ext/cuda/cross-entropy.cu
// against the same formulas in double on the host, and their time at a training
// step's shape (2048 rows of a 49,152-token vocabulary).
//
//   nvcc -O3 -arch=sm_90 -std=c++17 -o dream_ce_check bench/gpu/dream_ce_check.cu && ./dream_ce_check
//
// Cases: one-hot labels (what the dream stage trains on), soft labels that sum to
// one, a row length that is no multiple of four (the scalar path) and logits with
// a large offset (the max must be subtracted). Logits are drawn fresh per case
// and dst is poisoned (NaN) before the backward, so an unwritten element fails.
// Bounds: relative L2 of the gradient and relative error of the loss under 1e-5
// (F32 arithmetic; measured far below it).
#define DREAM_CE_NO_GGML
#include "../../dreamstage/ggml_ext/cuda/cross-entropy.cu"

#include <algorithm>
#include <cstdio>
#include <random>
#include <vector>

#define CK(x) do { cudaError_t e_ = (x); if (e_ != cudaSuccess) { std::printf("CUDA error %s at %s:%d\n", cudaGetErrorString(e_), __FILE__, __LINE__); std::exit(2); } } while (0)

struct ce_case { int64_t rows, cols; bool one_hot; float offset; const char * name; };

int main() {
    const ce_case cases[] = {
        { 2048, 49152, true, 0.0f, "2048 x 49152, one-hot" },
        { 64, 49152, false, 0.0f, "64 x 49152, soft labels" },
        { 37, 1001, true, 0.0f, "37 x 1001 (scalar path), one-hot" },
        { 16, 32000, true, 80.0f, "16 x 32000, logits offset by 80" },
    };
    std::mt19937 rng(20261202);
    bool ok = true;
    for (const auto & c : cases) {
        const int64_t n = c.rows * c.cols;
        std::vector<float> x(n), l(n, 0.0f);
        std::normal_distribution<float> nd(0.0f, 3.0f);
        std::uniform_int_distribution<int64_t> pick(0, c.cols - 1);
        std::uniform_real_distribution<float> ud(0.0f, 1.0f);
        for (auto & v : x) v = nd(rng) + c.offset;
        for (int64_t r = 0; r < c.rows; ++r) {
            if (c.one_hot) {
                l[r * c.cols + pick(rng)] = 1.0f;
            } else {
                double s = 0;
                for (int64_t j = 0; j < c.cols; ++j) s += (l[r * c.cols + j] = ud(rng));
                for (int64_t j = 0; j < c.cols; ++j) l[r * c.cols + j] = (float) (l[r * c.cols + j] / s);
            }
        }
        const float grad_in = 0.37f;
        // the reference in double
        double loss_ref = 0;
        std::vector<double> d_ref(n);
        for (int64_t r = 0; r < c.rows; ++r) {
            const float * xr = &x[r * c.cols];
            const float * lr = &l[r * c.cols];
            double m = -INFINITY, s = 0;
            for (int64_t j = 0; j < c.cols; ++j) m = std::max(m, (double) xr[j]);
            for (int64_t j = 0; j < c.cols; ++j) s += std::exp(xr[j] - m);
            const double lse = m + std::log(s);
            for (int64_t j = 0; j < c.cols; ++j) {
                loss_ref -= lr[j] * (xr[j] - lse) / c.rows;
                d_ref[r * c.cols + j] = (std::exp(xr[j] - lse) - lr[j]) * grad_in / c.rows;
            }
        }
        float *dx, *dl, *drows, *dd, *dg;
        CK(cudaMalloc(&dx, n * sizeof(float))); CK(cudaMalloc(&dl, n * sizeof(float))); CK(cudaMalloc(&dd, n * sizeof(float)));
        CK(cudaMalloc(&drows, c.rows * sizeof(float))); CK(cudaMalloc(&dg, sizeof(float)));
        CK(cudaMemcpy(dx, x.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dl, l.data(), n * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemcpy(dg, &grad_in, sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemset(dd, 0xff, n * sizeof(float)));   // NaN everywhere
        dream_cuda_ce_loss_rows(dx, dl, drows, c.cols, c.rows, 0);
        dream_cuda_ce_back(dg, dx, dl, dd, c.cols, c.rows, 0);
        CK(cudaGetLastError());
        CK(cudaDeviceSynchronize());
        std::vector<float> rows(c.rows), d(n);
        CK(cudaMemcpy(rows.data(), drows, c.rows * sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(d.data(), dd, n * sizeof(float), cudaMemcpyDeviceToHost));
        double loss = 0, num = 0, den = 0;
        bool finite = true;
        for (float v : rows) loss += v;
        for (int64_t i = 0; i < n; ++i) {
            finite = finite && std::isfinite(d[i]);
            num += (d[i] - d_ref[i]) * (d[i] - d_ref[i]);
            den += d_ref[i] * d_ref[i];
        }
        const double e_loss = std::fabs(loss - loss_ref) / std::fabs(loss_ref), e_grad = std::sqrt(num / den);
        const bool pass = finite && e_loss < 1e-5 && e_grad < 1e-5;
        ok = ok && pass;
        std::printf("%s  %-36s loss %.7f (ref %.7f, rel %.2e)  grad rel L2 %.2e%s\n", pass ? "PASS" : "FAIL", c.name, loss,
                    loss_ref, e_loss, e_grad, finite ? "" : " (non-finite elements)");
        if (c.rows == 2048) {
            cudaEvent_t e0, e1;
            CK(cudaEventCreate(&e0)); CK(cudaEventCreate(&e1));
            std::vector<float> tf, tb;
            for (int rep = 0; rep < 12; ++rep) {
                float t;
                CK(cudaEventRecord(e0)); dream_cuda_ce_loss_rows(dx, dl, drows, c.cols, c.rows, 0); CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&t, e0, e1)); if (rep >= 2) tf.push_back(t);
                CK(cudaEventRecord(e0)); dream_cuda_ce_back(dg, dx, dl, dd, c.cols, c.rows, 0); CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1)); CK(cudaEventElapsedTime(&t, e0, e1)); if (rep >= 2) tb.push_back(t);
            }
            std::sort(tf.begin(), tf.end()); std::sort(tb.begin(), tb.end());
            const double mb = n * sizeof(float) / 1e6;
            std::printf("  time: loss %.3f ms (%.0f GB/s over logits + labels), backward %.3f ms (%.0f GB/s over 2 reads of the logits, the labels, dst)\n",
                        tf[tf.size() / 2], 2 * mb / tf[tf.size() / 2], tb[tb.size() / 2], 4 * mb / tb[tb.size() / 2]);
        }
        cudaFree(dx); cudaFree(dl); cudaFree(dd); cudaFree(drows); cudaFree(dg);
    }
    std::printf("%s\n", ok ? "ALL PASS" : "SOME FAILED");
    return ok ? 0 : 1;
}
