// Soft targets for a plain window (dream.h, dream_window_soft_targets): the
// loss rows of its chunks are trained against given distributions over a few
// tokens each (the drift guard's rehearsal windows: the base model's own
// next-token distribution) instead of the one-hot of the next token.
// ggml's CROSS_ENTROPY_LOSS takes target probabilities already; the walk
// (dream-walk.cpp) only fills its label matrix from these rows on the host.
#include "dream-stage.h"

#include <cmath>
#include <cstring>

void dream_soft_clear(dream_stage & ds) {
    ds.win_soft_k = 0;
    ds.win_soft_ids.clear();
    ds.win_soft_p.clear();
    ds.win_soft_row.clear();
}

bool dream_soft_active(const dream_stage & ds) {
    return ds.win_soft_k > 0 && !ds.group.active;
}

void dream_soft_fill(const dream_stage & ds, int32_t p, const std::vector<int32_t> & targets, float * lab,
                     int64_t n_vocab) {
    const size_t k = (size_t) ds.win_soft_k;
    int64_t row = 0;
    for (size_t i = 0; i < targets.size(); ++i) {
        if (targets[i] < 0) {
            continue;
        }
        float * out = lab + row++ * n_vocab;
        std::memset(out, 0, sizeof(float) * (size_t) n_vocab);
        const int32_t r = ds.win_soft_row[(size_t) p + i + 1];
        for (size_t t = 0; t < k; ++t) {
            const int32_t id = ds.win_soft_ids[(size_t) r * k + t];
            if (id >= 0) {
                out[id] += ds.win_soft_p[(size_t) r * k + t];
            }
        }
    }
}

int32_t dream_window_soft_targets(struct dream_stage * ds, const int32_t * ids, const float * probs, int32_t k,
                                  int32_t n_rows, struct dream_receipt * receipt) {
    dream_receipt tmp;
    dream_receipt & r = receipt ? *receipt : tmp;
    dream_receipt_start(*ds, r);
    r.status = DREAM_STATUS_ERROR;
    const int64_t n_vocab = ds->model->vocab.n_tokens();
    if (!ds->win_active || ds->group.active || ds->win_pos != 0 || ds->win_reverse || ds->suspended.active) {
        dream_receipt_message(r, "soft targets need a window just begun (dream_window_begin, before its first micro-step)");
        return r.status;
    }
    if (!ids || !probs || k < 1 || k > n_vocab) {
        dream_receipt_message(r, "soft targets: k %d must be 1..%lld, with ids and probs given", k, (long long) n_vocab);
        return r.status;
    }
    if (n_rows != ds->win_n_masked) {
        dream_receipt_message(r, "soft targets: n_rows %d must be the window's %d loss tokens", n_rows, ds->win_n_masked);
        return r.status;
    }
    std::vector<float> p(probs, probs + (size_t) n_rows * k);
    for (int32_t row = 0; row < n_rows; ++row) {
        double sum = 0.0;
        for (int32_t t = 0; t < k; ++t) {
            const size_t at = (size_t) row * k + t;
            const int32_t id = ids[at];
            const float v = p[at];
            if (!std::isfinite(v) || v < 0.0f || id < -1 || id >= n_vocab || (id == -1 && v != 0.0f)) {
                dream_receipt_message(r, "soft targets: row %d, pair %d: id %d with probability %g (ids 0..%lld, or -1 "
                                      "with 0; probabilities finite and >= 0)", row, t, id, (double) v,
                                      (long long) n_vocab - 1);
                return r.status;
            }
            sum += v;
        }
        if (!(std::fabs(sum - 1.0) <= 1e-3)) {
            dream_receipt_message(r, "soft targets: row %d's probabilities sum to %.6g, not 1 (within 1e-3)", row, sum);
            return r.status;
        }
        for (int32_t t = 0; t < k; ++t) {
            p[(size_t) row * k + t] = (float) (p[(size_t) row * k + t] / sum);
        }
    }
    ds->win_soft_k = k;
    ds->win_soft_ids.assign(ids, ids + (size_t) n_rows * k);
    ds->win_soft_p = std::move(p);
    ds->win_soft_row.assign((size_t) ds->win_n, -1);
    int32_t row = 0;
    for (int32_t j = 1; j < ds->win_n; ++j) {
        if (ds->win_mask[j]) {
            ds->win_soft_row[(size_t) j] = row++;
        }
    }
    r.status = DREAM_STATUS_OK;
    return r.status;
}
