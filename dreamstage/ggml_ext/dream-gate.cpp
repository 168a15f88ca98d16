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

dream_gate_verdict dream_gate_check(dream_stage & ds, const std::vector<std::pair<ggml_backend_dev_t, size_t>> & needs) {
    // each device's total, in ggml's device order (a null device: no CPU device registered)
    std::vector<std::pair<ggml_backend_dev_t, size_t>> per_dev;
    auto add = [&](ggml_backend_dev_t dev, size_t bytes) {
        for (auto & [d, b] : per_dev) {
            if (d == dev) {
                b += bytes;
                return;
            }
        }
        per_dev.push_back({ dev, bytes });
    };
    for (const auto & [dev, bytes] : needs) {
        add(dev ? dev : dream_host_device(), bytes);
    }
    auto order = [](ggml_backend_dev_t d) {
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            if (ggml_backend_dev_get(i) == d) {
                return i;
            }
        }
        return ggml_backend_dev_count();
    };
    std::stable_sort(per_dev.begin(), per_dev.end(), [&](const auto & a, const auto & b) { return order(a.first) < order(b.first); });
    dream_gate_verdict v;
    bool first = true;
    ds.exec.last_gate.clear();
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
        dream_gate_device row{};
        std::snprintf(row.device, sizeof row.device, "%s", dev ? ggml_backend_dev_name(dev) : "CPU");
        row.need_mib = need;
        row.allowance_mib = allowance;
        ds.exec.last_gate.push_back(row);
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

int32_t dream_gate_devices(const struct dream_stage * ds, struct dream_gate_device * out, int32_t n) {
    if (!ds) {
        return 0;
    }
    const auto & rows = ds->exec.last_gate;
    for (int32_t i = 0; out && i < n && i < (int32_t) rows.size(); ++i) {
        out[i] = rows[i];
    }
    return (int32_t) rows.size();
}
