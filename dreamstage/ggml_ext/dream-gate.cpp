// The memory gate: a chunk (or the job's start) may allocate only what fits.
// need comes from ggml's allocator planning the real graph (dream-step.cpp);
// allowance = min(budget left to the job, device free) - slack, per device.
// The CPU is a device too (free = the host's available memory, MemAvailable).
#include "dream-stage.h"

#include "ggml-backend.h"
#include "llama-impl.h"   // format()

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <map>

// A CPU device's free memory: Linux's MemAvailable (ggml's CPU device reports the
// host's total as free, which would never see what serving holds); ggml's figure
// where /proc/meminfo is absent.
static size_t dream_device_free(ggml_backend_dev_t dev) {
    size_t free = 0, total = 0;
    ggml_backend_dev_memory(dev, &free, &total);
    if (ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
        return free;
    }
    FILE * f = std::fopen("/proc/meminfo", "r");
    if (!f) {
        return free;
    }
    char line[256];
    unsigned long long kib = 0;
    bool found = false;
    while (!found && std::fgets(line, sizeof line, f)) {
        found = std::sscanf(line, "MemAvailable: %llu kB", &kib) == 1;
    }
    std::fclose(f);
    return found ? (size_t) kib * 1024 : free;
}

double dream_held_mib(const struct dream_stage * ds) {
    return dream_held_mib(*ds);
}

double dream_held_mib(const dream_stage & ds) {
    const size_t opt = dream_opt_bytes(ds);
    size_t pools = 0;
    for (const auto & [dev, bytes] : ds.exec.pool_held) {
        pools += bytes;
    }
    // the training graph's own compute buffers are the job's memory too
    return (double) (ds.lora.bytes + ds.mem.context_bytes + ds.mem.walk_bytes + opt + dream_sched_held_bytes(ds) + pools) /
           DREAM_MIB;
}

dream_gate_verdict dream_gate_check(const dream_stage & ds, const std::vector<std::pair<ggml_backend_dev_t, size_t>> & needs) {
    std::map<ggml_backend_dev_t, size_t> per_dev;
    for (const auto & [dev, bytes] : needs) {
        per_dev[dev ? dev : dream_host_device()] += bytes;
    }
    dream_gate_verdict v;
    bool first = true;
    for (const auto & [dev, bytes] : per_dev) {
        const size_t free = dev ? dream_device_free(dev) : 0;
        const double free_mib = (double) free / DREAM_MIB, slack = ds.params.slack_mib;
        double allowance = free_mib - slack;
        std::string why;
        if (allowance < 0) {
            why = format("; the device's free memory (%.2f MiB) is below the slack (%.2f MiB)", free_mib, slack);
        }
        if (ds.params.memory_budget_mib > 0) {
            const double held = dream_held_mib(ds), left = ds.params.memory_budget_mib - held - slack;
            if (left < allowance) {
                allowance = left;
                why = left >= 0 ? "" : format("; the budget (%.2f MiB) is below what the job already holds "
                                                     "(%.2f MiB) plus the slack (%.2f MiB)",
                                                     ds.params.memory_budget_mib, held, slack);
            }
        }
        // a negative allowance would read as a debt: it is 0, and `why` says what is short
        allowance = std::max(allowance, 0.0);
        const double need = (double) bytes / DREAM_MIB;
        // report the device with the least headroom (the refusing one, if any)
        if (first || need - allowance > v.need_mib - v.allowance_mib) {
            v.need_mib = need;
            v.allowance_mib = allowance;
            v.device = dev ? ggml_backend_dev_name(dev) : "CPU";
            v.why = why;
            first = false;
        }
        if (need > allowance) {
            v.fits = false;
        }
    }
    return v;
}
