// The RPC backend's counters as the dream stage reads them (receipts'
// rpc_bytes, a worker that failed during a micro-step): through the proc
// address the ggml-rpc hooks export (dreamstage/ggml_ext/rpc/rpc-hooks.cpp),
// so libllama needs no link to ggml-rpc and a build without it reads zeros.
#include "dream-stage.h"

#include "ggml-backend.h"

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace {
using dream_rpc_traffic_fn = void (*)(uint64_t * sent, uint64_t * received, uint64_t * failures, char * last_failed,
                                      size_t cap);

dream_rpc_traffic_fn dream_rpc_traffic() {
    static const dream_rpc_traffic_fn fn = [] {
        ggml_backend_reg_t reg = ggml_backend_reg_by_name("RPC");
        return reg ? (dream_rpc_traffic_fn) ggml_backend_reg_get_proc_address(reg, "dream_rpc_traffic") : nullptr;
    }();
    return fn;
}
}

uint64_t dream_rpc_bytes() {
    uint64_t sent = 0, received = 0, failures = 0;
    if (auto fn = dream_rpc_traffic()) {
        fn(&sent, &received, &failures, nullptr, 0);
    }
    return sent + received;
}

uint64_t dream_rpc_failures(std::string * last) {
    uint64_t sent = 0, received = 0, failures = 0;
    char name[256] = "";
    if (auto fn = dream_rpc_traffic()) {
        fn(&sent, &received, &failures, name, sizeof(name));
    }
    if (last) {
        *last = name;
    }
    return failures;
}

static bool dream_dev_is_rpc(ggml_backend_dev_t dev) {
    ggml_backend_reg_t reg = dev ? ggml_backend_dev_backend_reg(dev) : nullptr;
    return reg && std::strcmp(ggml_backend_reg_name(reg), "RPC") == 0;
}

bool dream_sched_has_rpc(ggml_backend_sched_t sched) {
    for (int b = 0; sched && b < ggml_backend_sched_get_n_backends(sched); ++b) {
        if (dream_dev_is_rpc(ggml_backend_get_device(ggml_backend_sched_get_backend(sched, b)))) {
            return true;
        }
    }
    return false;
}
