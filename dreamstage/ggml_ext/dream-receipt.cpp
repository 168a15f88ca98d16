// Receipts: every call that does work fills one, with the job's shape first.
#include "dream-stage.h"

#include <cstdarg>
#include <cstddef>
#include <cstdio>
#include <cstring>

void dream_receipt_start(const dream_stage & ds, dream_receipt & r) {
    std::memset(&r, 0, sizeof(r));
    r.status = DREAM_STATUS_OK;
    r.step = ds.step;
    r.window = ds.params.window;
    r.chunk = ds.params.chunk;
    r.chunk_pos = ds.win.pos;
    r.chunk_tokens = 0;
    std::snprintf(r.context_cache_type, sizeof(r.context_cache_type), "%s", ds.cache_type_str.c_str());
    r.recompute = ds.params.recompute;
    r.exact = ds.params.exact;
    r.horizon = ds.params.exact ? ds.mem.horizon : -1;
    std::snprintf(r.walk_pass, sizeof(r.walk_pass), "%s", "");
    r.context_mib = (double) ds.mem.context_bytes / DREAM_MIB;
    r.adapter_mib = (double) ds.lora.bytes / DREAM_MIB;
    r.optimizer_mib = (double) dream_opt_bytes(ds) / DREAM_MIB;
    r.walk_mib = (double) ds.mem.walk_bytes / DREAM_MIB;
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

void dream_receipt_refused(dream_receipt & r, int32_t pos, int32_t tokens, const dream_gate_verdict & v) {
    r.refused_chunk_pos = pos;
    r.refused_chunk_tokens = tokens;
    r.refused_need_mib = v.need_mib;
    r.refused_allowance_mib = v.allowance_mib;
    std::snprintf(r.refused_device, sizeof(r.refused_device), "%s", v.device.c_str());
}

// Every member of struct dream_receipt, in declaration order, for
// dream_receipt_layout. A member missing here leaves a gap the check below
// sees (unless it hides in padding, which Python's comparison then catches
// by name).
#define DREAM_RECEIPT_MEMBER(m) { #m, offsetof(dream_receipt, m), sizeof(((dream_receipt *) nullptr)->m) }
static const dream_field_layout k_receipt_layout[] = {
    DREAM_RECEIPT_MEMBER(status), DREAM_RECEIPT_MEMBER(step), DREAM_RECEIPT_MEMBER(window),
    DREAM_RECEIPT_MEMBER(chunk), DREAM_RECEIPT_MEMBER(chunk_pos), DREAM_RECEIPT_MEMBER(chunk_tokens),
    DREAM_RECEIPT_MEMBER(context_cache_type), DREAM_RECEIPT_MEMBER(recompute), DREAM_RECEIPT_MEMBER(exact),
    DREAM_RECEIPT_MEMBER(horizon), DREAM_RECEIPT_MEMBER(walk_pass), DREAM_RECEIPT_MEMBER(loss),
    DREAM_RECEIPT_MEMBER(tokens), DREAM_RECEIPT_MEMBER(ms), DREAM_RECEIPT_MEMBER(graph_mib),
    DREAM_RECEIPT_MEMBER(context_mib), DREAM_RECEIPT_MEMBER(adapter_mib), DREAM_RECEIPT_MEMBER(optimizer_mib),
    DREAM_RECEIPT_MEMBER(walk_mib), DREAM_RECEIPT_MEMBER(refused_chunk_pos), DREAM_RECEIPT_MEMBER(refused_chunk_tokens),
    DREAM_RECEIPT_MEMBER(refused_need_mib), DREAM_RECEIPT_MEMBER(refused_allowance_mib), DREAM_RECEIPT_MEMBER(message),
    DREAM_RECEIPT_MEMBER(group_reply), DREAM_RECEIPT_MEMBER(aborted_had_ms), DREAM_RECEIPT_MEMBER(aborted_need_ms),
    DREAM_RECEIPT_MEMBER(refused_device), DREAM_RECEIPT_MEMBER(rpc_bytes),
};
#undef DREAM_RECEIPT_MEMBER

// The last member ends the struct (up to its alignment): a member appended
// to the struct but not to the table fails the build here.
static_assert(offsetof(dream_receipt, rpc_bytes) + sizeof(((dream_receipt *) nullptr)->rpc_bytes) + alignof(dream_receipt) >
              sizeof(dream_receipt), "k_receipt_layout must end with the last member of struct dream_receipt");

extern "C" int32_t dream_receipt_layout(const dream_field_layout ** fields, size_t * struct_size) {
    if (fields) {
        *fields = k_receipt_layout;
    }
    if (struct_size) {
        *struct_size = sizeof(dream_receipt);
    }
    return (int32_t) (sizeof(k_receipt_layout) / sizeof(k_receipt_layout[0]));
}
