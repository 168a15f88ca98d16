// Soft targets for a plain window (dream.h, dream_window_soft_targets): the
// loss rows of its chunks are trained against given distributions over a few
// tokens each (the drift guard's rehearsal windows: the base model's own
// next-token distribution) instead of the one-hot of the next token.
// ggml's CROSS_ENTROPY_LOSS takes target probabilities already; the walk
// (dream-step.cpp) only fills its label matrix from these rows on the host.
//
// A row may leave mass out: the drift guard records the base's top 256 tokens,
// which hold all but 1.4 % of its mass on the default model on average (up to
// 25 % at a position). Renormalized over those tokens, the target asked the
// model to move that mass onto them: at the base itself the loss sat 0.018
// nats a token above its minimum, and the rehearsal pulled the adapter away
// from the base it was meant to hold (its own anchors drifted more than the
// held-out ones). The rest is therefore one more outcome, "any other token":
// each row's loss is -sum_i p_i log q_i - rest log(sum of q_j over the tokens
// outside the row), whose gradient is zero where the model is the target, and
// that is dream_soft_rest_ce below (a custom op with its own backward, CPU
// only: on a GPU the scheduler runs these two nodes on the host). A window
// whose rows all sum to one keeps ggml's CROSS_ENTROPY_LOSS.
#include "dream-stage.h"

#include <algorithm>
#include <cmath>
#include <cstring>

void dream_soft_clear(dream_stage & ds) {
    ds.win.soft_k = 0;
    ds.win.soft_ids.clear();
    ds.win.soft_p.clear();
    ds.win.soft_row.clear();
    ds.win.soft_rest.clear();
}

bool dream_soft_has_rest(const dream_stage & ds) {
    return dream_soft_active(ds) &&
           std::any_of(ds.win.soft_rest.begin(), ds.win.soft_rest.end(), [](float x) { return x > 0.0f; });
}

bool dream_soft_active(const dream_stage & ds) {
    return ds.win.soft_k > 0 && !ds.group.active;
}

void dream_soft_fill(const dream_stage & ds, int32_t p, const std::vector<int32_t> & targets, float * lab,
                     int64_t n_vocab, float * rest) {
    const size_t k = (size_t) ds.win.soft_k;
    int64_t row = 0;
    for (size_t i = 0; i < targets.size(); ++i) {
        if (targets[i] < 0) {
            continue;
        }
        const int32_t r = ds.win.soft_row[(size_t) p + i + 1];
        if (rest) {
            rest[row] = ds.win.soft_rest[(size_t) r];
        }
        float * out = lab + row++ * n_vocab;
        std::memset(out, 0, sizeof(float) * (size_t) n_vocab);
        for (size_t t = 0; t < k; ++t) {
            const int32_t id = ds.win.soft_ids[(size_t) r * k + t];
            if (id >= 0) {
                out[id] += ds.win.soft_p[(size_t) r * k + t];
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
    if (!ds->win.active || ds->group.active || ds->win.pos != 0 || ds->win.reverse || ds->exec.suspended.active) {
        dream_receipt_message(r, "soft targets need a window just begun (dream_window_begin, before its first micro-step)");
        return r.status;
    }
    if (!ids || !probs || k < 1 || k > n_vocab) {
        dream_receipt_message(r, "soft targets: k %d must be 1..%lld, with ids and probs given", k, (long long) n_vocab);
        return r.status;
    }
    if (n_rows != ds->win.n_masked) {
        dream_receipt_message(r, "soft targets: n_rows %d must be the window's %d loss tokens", n_rows, ds->win.n_masked);
        return r.status;
    }
    std::vector<float> p(probs, probs + (size_t) n_rows * k);
    std::vector<float> rest((size_t) n_rows, 0.0f);
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
        if (!(sum <= 1.0 + 1e-3)) {
            dream_receipt_message(r, "soft targets: row %d's probabilities sum to %.6g, over 1 (by more than 1e-3)",
                                  row, sum);
            return r.status;
        }
        if (sum > 1.0) {      // rounding: rescaled to 1 exactly
            for (int32_t t = 0; t < k; ++t) {
                p[(size_t) row * k + t] = (float) (p[(size_t) row * k + t] / sum);
            }
        }
        rest[(size_t) row] = sum < 1.0 ? (float) (1.0 - sum) : 0.0f;
    }
    ds->win.soft_k = k;
    ds->win.soft_ids.assign(ids, ids + (size_t) n_rows * k);
    ds->win.soft_p = std::move(p);
    ds->win.soft_rest = std::move(rest);
    ds->win.soft_row.assign((size_t) ds->win.n, -1);
    int32_t row = 0;
    for (int32_t j = 1; j < ds->win.n; ++j) {
        if (ds->win.mask[j]) {
            ds->win.soft_row[(size_t) j] = row++;
        }
    }
    r.status = DREAM_STATUS_OK;
    return r.status;
}

// ---- the loss with the rest as one outcome (dream_soft_rest_ce) ----
namespace {

// One row's statistics, in double: its max, the sum of exp(z - max) over every
// token and over the tokens the labels leave at 0 (the rest's), and
// sum_i lab_i (z_i - max) with sum_i lab_i.
struct soft_row_stats {
    float  mx = 0.0f;
    double total = 0.0, tail = 0.0, dot = 0.0, mass = 0.0;
};

soft_row_stats soft_row(const float * z, const float * lab, int64_t nv) {
    soft_row_stats st;
    st.mx = *std::max_element(z, z + nv);
    for (int64_t i = 0; i < nv; ++i) {
        const double e = std::exp((double) (z[i] - st.mx));
        st.total += e;
        if (lab[i] > 0.0f) {
            st.dot += (double) lab[i] * (double) (z[i] - st.mx);
            st.mass += lab[i];
        } else {
            st.tail += e;
        }
    }
    return st;
}

// rows of src[0] (logits), src[1] (labels), src[2] (rest): dst[r] = row r's loss
void soft_rest_ce_cpu(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * z = dst->src[0], * lab = dst->src[1], * rest = dst->src[2];
    const int64_t nv = z->ne[0], nr = z->ne[1];
    for (int64_t r = ith; r < nr; r += nth) {
        const float * zr = (const float *) ((const char *) z->data + r * z->nb[1]);
        const soft_row_stats st = soft_row(zr, (const float *) ((const char *) lab->data + r * lab->nb[1]), nv);
        const double lse = std::log(st.total);      // log-sum-exp less the max
        double loss = st.mass * lse - st.dot;      // -sum_i lab_i log q_i
        const double rr = ((const float *) rest->data)[r];
        if (rr > 0.0) {
            loss -= rr * (std::log(std::max(st.tail, 1e-300)) - lse);   // - rest log Q_rest
        }
        ((float *) dst->data)[r] = (float) loss;
    }
}

// src[0] the rows' gradient, src[1..3] as above: dst [n_vocab, rows] the logits' gradient,
// g_r (q - lab - rest q / Q_rest on the rest's tokens)
void soft_rest_ce_back_cpu(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * g = dst->src[0], * z = dst->src[1], * lab = dst->src[2], * rest = dst->src[3];
    const int64_t nv = z->ne[0], nr = z->ne[1];
    for (int64_t r = ith; r < nr; r += nth) {
        const float * zr = (const float *) ((const char *) z->data + r * z->nb[1]);
        const float * lr = (const float *) ((const char *) lab->data + r * lab->nb[1]);
        float * out = (float *) ((char *) dst->data + r * dst->nb[1]);
        const soft_row_stats st = soft_row(zr, lr, nv);
        const double gr = ((const float *) g->data)[r];
        const double rr = ((const float *) rest->data)[r];
        // q_j / Q_rest = exp(z_j - max) / tail: at most 1, so the rest's term stays within rest
        const double to_tail = rr > 0.0 && st.tail > 0.0 ? rr / st.tail : 0.0;
        for (int64_t i = 0; i < nv; ++i) {
            const double e = std::exp((double) (zr[i] - st.mx));
            const double d = lr[i] > 0.0f ? e / st.total - lr[i] : e / st.total - to_tail * e;
            out[i] = (float) (gr * d);
        }
    }
}

}  // namespace

bool dream_is_soft_rest_ce(const ggml_tensor * t) {
    return dream_is_custom(t, DREAM_CUSTOM_SOFT_REST_CE);
}

ggml_tensor * dream_soft_rest_ce(ggml_context * ctx, ggml_tensor * logits, ggml_tensor * labels, ggml_tensor * rest) {
    GGML_ASSERT(logits->type == GGML_TYPE_F32 && labels->type == GGML_TYPE_F32 && rest->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_are_same_shape(logits, labels) && ggml_n_dims(logits) <= 2 && rest->ne[0] == logits->ne[1] &&
                ggml_nelements(rest) == rest->ne[0] && logits->nb[0] == sizeof(float) && labels->nb[0] == sizeof(float));
    ggml_tensor * args[3] = { logits, labels, rest };
    ggml_tensor * rows = dream_custom_tagged(ggml_custom_4d(ctx, GGML_TYPE_F32, logits->ne[1], 1, 1, 1, args, 3,
                                                            soft_rest_ce_cpu, GGML_N_TASKS_MAX, nullptr),
                                             DREAM_CUSTOM_SOFT_REST_CE);
    ggml_set_name(rows, "dream_soft_rest_ce");
    return ggml_scale(ctx, ggml_sum(ctx, rows), 1.0f / (float) logits->ne[1]);   // the mean over rows
}

bool dream_soft_rest_backward(ggml_context * ctx, ggml_tensor * t, ggml_tensor * grad, ggml_tensor ** out) {
    if (!dream_is_soft_rest_ce(t)) {
        return false;
    }
    ggml_tensor * z = t->src[0];
    ggml_tensor * args[4] = { ggml_is_contiguous(grad) ? grad : ggml_cont(ctx, grad), z, t->src[1], t->src[2] };
    ggml_tensor * dz = dream_custom_tagged(ggml_custom_4d(ctx, GGML_TYPE_F32, z->ne[0], z->ne[1], 1, 1, args, 4,
                                                          soft_rest_ce_back_cpu, GGML_N_TASKS_MAX, nullptr),
                                           DREAM_CUSTOM_SOFT_REST_CE_BACK);
    ggml_set_name(dz, "dream_soft_rest_ce_back");
    out[0] = dz;       // the labels and the rest are inputs: no gradient
    return true;
}
