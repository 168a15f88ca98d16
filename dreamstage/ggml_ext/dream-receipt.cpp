// Receipts: every call that does work fills one, with the job's shape first.
#include "dream-stage.h"

#include <cstdarg>
#include <cstdio>
#include <cstring>

void dream_receipt_start(const dream_stage & ds, dream_receipt & r) {
    std::memset(&r, 0, sizeof(r));
    r.status = DREAM_STATUS_OK;
    r.step = ds.step;
    r.window = ds.params.window;
    r.chunk = ds.params.chunk;
    r.chunk_pos = ds.win_pos;
    r.chunk_tokens = 0;
    std::snprintf(r.context_cache_type, sizeof(r.context_cache_type), "%s", ds.cache_type_str.c_str());
    r.recompute = ds.params.recompute;
    r.exact = ds.params.exact;
    r.horizon = ds.params.exact ? ds.horizon : -1;
    std::snprintf(r.walk_pass, sizeof(r.walk_pass), "%s", "");
    r.context_mib = (double) ds.context_bytes / DREAM_MIB;
    r.adapter_mib = (double) ds.adapter_bytes / DREAM_MIB;
    r.optimizer_mib = (double) ((ds.grad_acc.size() + ds.adam_m.size() + ds.adam_v.size()) * sizeof(float)) / DREAM_MIB;
    r.walk_mib = (double) ds.walk_bytes / DREAM_MIB;
    r.refused_chunk_pos = -1;
    r.refused_chunk_tokens = 0;
    r.group_reply = -1;
}

void dream_receipt_message(dream_receipt & r, const char * fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::vsnprintf(r.message, sizeof(r.message), fmt, ap);
    va_end(ap);
}

void dream_receipt_refused(dream_receipt & r, int32_t pos, int32_t tokens, double need_mib, double allowance_mib) {
    r.refused_chunk_pos = pos;
    r.refused_chunk_tokens = tokens;
    r.refused_need_mib = need_mib;
    r.refused_allowance_mib = allowance_mib;
}
