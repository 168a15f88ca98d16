// The RPC backend's hooks (vendor/patches/0110-*), compiled into ggml-rpc:
// the client's and the worker's side of the same library.
//   - what crossed the wire: every command's bytes sent and answered, summed
//     process-wide (a connection's counters are not kept apart);
//   - a connection that failed: counted and named; the patched dispatcher then
//     drops that connection's commands instead of aborting the process;
//   - ops never sent to a worker and never run by one: GGML_OP_CUSTOM and the
//     MAP_CUSTOM ops carry a function pointer (and userdata) of the process that
//     built the graph, meaningless (or hostile) in another one. The scheduler
//     runs them on a local backend instead, moving their inputs.
// Read through ggml_backend_reg_get_proc_address(RPC, "dream_rpc_traffic").
#include "ggml.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

namespace {
std::atomic<uint64_t> g_sent { 0 };
std::atomic<uint64_t> g_received { 0 };
std::atomic<uint64_t> g_failures { 0 };
std::mutex g_failed_mutex;
std::string g_last_failed;   // the endpoint of the last connection that failed
}

void dream_rpc_count(uint64_t sent, uint64_t received) {
    g_sent.fetch_add(sent, std::memory_order_relaxed);
    g_received.fetch_add(received, std::memory_order_relaxed);
}

void dream_rpc_failed(const char * endpoint) {
    {
        std::lock_guard<std::mutex> lock(g_failed_mutex);
        g_last_failed = endpoint ? endpoint : "";
    }
    g_failures.fetch_add(1);
    std::fprintf(stderr, "dreamstage: the RPC worker at %s failed; its commands are dropped\n", endpoint ? endpoint : "?");
}

bool dream_rpc_op_allowed(const ggml_tensor * op) {
    switch (op->op) {
        case GGML_OP_MAP_CUSTOM1:
        case GGML_OP_MAP_CUSTOM2:
        case GGML_OP_MAP_CUSTOM3:
        case GGML_OP_CUSTOM:
            return false;
        default:
            return true;
    }
}

// The totals so far; last_failed gets the endpoint of the last failed connection ("" if none).
extern "C" void dream_rpc_traffic(uint64_t * sent, uint64_t * received, uint64_t * failures, char * last_failed,
                                  size_t cap) {
    *sent = g_sent.load();
    *received = g_received.load();
    *failures = g_failures.load();
    if (last_failed && cap > 0) {
        std::lock_guard<std::mutex> lock(g_failed_mutex);
        std::snprintf(last_failed, cap, "%s", g_last_failed.c_str());
    }
}

void * dream_rpc_proc_address(const char * name) {
    return std::strcmp(name, "dream_rpc_traffic") == 0 ? (void *) dream_rpc_traffic : nullptr;
}
