// The RPC backend's hooks (vendor/patches/0110-*), compiled into ggml-rpc:
// the client's and the worker's side of the same library.
//   - what crossed the wire: every command's bytes sent and answered, summed
//     process-wide (a connection's counters are not kept apart);
//   - a connection that failed: counted and named; the patched dispatcher then
//     drops that connection's commands instead of aborting the process, and
//     their zeroed answers must never reach code that asserts on them: a new
//     buffer's base is asked for at once (a NULL one fails the allocation, as
//     a NULL buffer does, where ggml would assert at its first use), and a
//     buffer type made from zeroed answers gets values that allocate nothing
//     harmful and is not kept;
//   - a new connection's handshake has a deadline (HANDSHAKE_MS, or the
//     silence bound where that is shorter): a listener that accepts and says
//     nothing (a stopped worker, one busy with another client) fails it;
//     afterwards a wait on the worker is bounded by the silence the process
//     set (dream_rpc_set_silence; 0: none), so a worker that hangs while a
//     model uploads fails the load;
//   - ops never sent to a worker and never run by one: GGML_OP_CUSTOM and the
//     MAP_CUSTOM ops carry a function pointer (and userdata) of the process that
//     built the graph, meaningless (or hostile) in another one. The scheduler
//     runs them on a local backend instead, moving their inputs.
// Read through ggml_backend_reg_get_proc_address(RPC, "dream_rpc_traffic"), set through "dream_rpc_set_silence".
#include "ggml.h"
#include "ggml-backend-impl.h"

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#ifndef _WIN32
#include <sys/socket.h>
#include <sys/time.h>
#endif

namespace {
std::atomic<uint64_t> g_sent { 0 };
std::atomic<uint64_t> g_received { 0 };
std::atomic<uint64_t> g_failures { 0 };
std::mutex g_failed_mutex;
std::string g_last_failed;   // the endpoint of the last connection that failed
constexpr int HANDSHAKE_MS = 10000;
std::atomic<int> g_silence_ms { 0 };        // a new connection's bound after its handshake (0: none)
thread_local intptr_t t_connecting = -1;   // the connection whose handshake this thread is making

void set_deadline(intptr_t fd, int ms) {
#ifndef _WIN32
    timeval tv { ms / 1000, (ms % 1000) * 1000 };
    setsockopt((int) fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt((int) fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
#else
    (void) fd; (void) ms;
#endif
}
}

// How long a connection made from now on may wait on its worker once its handshake is done.
extern "C" void dream_rpc_set_silence(double seconds) {
    g_silence_ms.store(seconds > 0 ? (int) (seconds * 1000 + 0.5) : 0);
}

// A connection ggml-rpc just made (transport.cpp): its handshake must answer within HANDSHAKE_MS, or
// within the silence bound where that is shorter.
void dream_rpc_connecting(intptr_t fd) {
    t_connecting = fd;
    const int silence = g_silence_ms.load();
    set_deadline(fd, silence > 0 && silence < HANDSHAKE_MS ? silence : HANDSHAKE_MS);
}

// The dispatcher's handshake ended (answered or failed, on this thread): the silence bound from now on.
void dream_rpc_handshake_done() {
    if (t_connecting >= 0) {
        set_deadline(t_connecting, g_silence_ms.load());
        t_connecting = -1;
    }
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

// A new buffer's base, asked for now: ggml asks at the buffer's first use and asserts on
// NULL, which is what a worker that failed in between answers. False: the buffer is freed.
bool dream_rpc_buffer_based(ggml_backend_buffer_t buffer) {
    if (buffer->iface.get_base(buffer) != nullptr) {
        return true;
    }
    ggml_backend_buffer_free(buffer);
    return false;
}

// A buffer type's alignment and max size, answered by a worker that failed (`failed`: zeros)
// or not. Zeros would divide by zero in ggml's allocators: a failed worker's type gets the
// smallest alignment and no size limit (its allocations fail anyway, the worker being gone).
// False: the type is not kept, so the worker's next connection asks again.
bool dream_rpc_buft_answered(bool failed, size_t * alignment, size_t * max_size) {
    if (!failed && *alignment != 0) {
        return true;
    }
    *alignment = 1;
    *max_size = SIZE_MAX;
    return false;
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
    if (std::strcmp(name, "dream_rpc_traffic") == 0) {
        return (void *) dream_rpc_traffic;
    }
    return std::strcmp(name, "dream_rpc_set_silence") == 0 ? (void *) dream_rpc_set_silence : nullptr;
}
