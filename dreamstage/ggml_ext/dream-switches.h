// Every environment switch of the native core, declared once: its variable, its
// default and how its value reads. libllama, ggml-cpu and ggml-cuda (separate
// libraries) each read the registry once, at their first use of it
// (dream_switches_loaded); a stage reads it again at dream_init into
// dream_stage::switches and uses that copy everywhere after. Nothing reads the
// environment per call or per graph. Plain C++: included by .cpp and .cu alike.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

// where the optimizer's state lives (DREAMSTAGE_OPTIMIZER)
enum dream_opt_where { DREAM_OPT_AUTO, DREAM_OPT_HOST, DREAM_OPT_DEVICE };

// how the adapter bank gathers each token's adapter (DREAMSTAGE_BANK_GATHER)
enum dream_bank_gather { DREAM_BANK_AUTO, DREAM_BANK_ID, DREAM_BANK_DENSE, DREAM_BANK_BGMV };

struct dream_switches {
    // NVIDIA_TF32_OVERRIDE=0: the FP32 mode, exact F32 products throughout (no fused attention, no F16 products)
    bool fp32_mode = false;
    // DREAMSTAGE_PROFILE=1: time every node of each training graph and print the time per op; =2: by shape too
    int profile = 0;
    // DREAMSTAGE_OPTIMIZER=host|device: where the optimizer's state lives; unset: on the adapter's devices unless it lies wholly on the CPU
    dream_opt_where optimizer = DREAM_OPT_AUTO;
    // DREAMSTAGE_FUSED_ATTN=0: training graphs compute attention as explicit products, not the fused CUDA backward
    bool fused_attn = true;
    // DREAMSTAGE_CPU_BACKWARD=panel: the CPU backward through a quantized weight uses the panel kernel, not the fused one
    bool cpu_backward_fused = true;
    // DREAMSTAGE_CPU_MUL_MAT=ggml: Q4_1 products keep ggml's vec_dot, not the batched kernel
    bool cpu_mul_mat = true;
    // DREAMSTAGE_CPU_GRAPH=ggml: a training graph wholly on the CPU keeps ggml's ops (F32 OUT_PROD,
    // cross-entropy, SILU_BACK, strided products), as one with an RPC worker or a GPU in it does
    bool cpu_graph_kernels = true;
    // DREAMSTAGE_CUDA_TRAIN_MMQ=1: training graphs keep serving's quantized CUDA kernels (8-bit activations)
    bool cuda_train_mmq = false;
    // DREAMSTAGE_CE_KERNEL=0: cross-entropy and its backward on CUDA stay ggml's
    bool ce_kernel = true;
    // DREAMSTAGE_LORA_FUSION=0: a served adapter's decode keeps upstream's nodes, not the fused kernel
    bool lora_fusion = true;
    // DREAMSTAGE_F16_PRODUCTS=0: training's quantized products on CUDA take F32 operands, not F16
    bool f16_products = true;
    // DREAMSTAGE_CUDA_OUT_PROD_MATH=fp32: the quantized OUT_PROD's SGEMM in full FP32, not TF32
    bool out_prod_fp32 = false;
    // DREAMSTAGE_BANK_GATHER=id|dense|bgmv: the adapter bank's term through MUL_MAT_ID, through
    // every slot's product masked per token, or one gathering op per weight (a CUDA kernel);
    // unset: MUL_MAT_ID on the CPU, bgmv on a GPU
    dream_bank_gather bank_gather = DREAM_BANK_AUTO;
};

namespace dream_switches_detail {
inline bool is(const char * name, const char * value) {
    const char * v = std::getenv(name);
    return v != nullptr && std::strcmp(v, value) == 0;
}
}

// The environment now, parsed.
inline dream_switches dream_switches_read() {
    using dream_switches_detail::is;
    dream_switches s;
    s.fp32_mode = is("NVIDIA_TF32_OVERRIDE", "0");
    s.profile = is("DREAMSTAGE_PROFILE", "1") ? 1 : is("DREAMSTAGE_PROFILE", "2") ? 2 : 0;
    s.optimizer = is("DREAMSTAGE_OPTIMIZER", "host")     ? DREAM_OPT_HOST
                  : is("DREAMSTAGE_OPTIMIZER", "device") ? DREAM_OPT_DEVICE
                                                         : DREAM_OPT_AUTO;
    s.fused_attn = !is("DREAMSTAGE_FUSED_ATTN", "0");
    s.cpu_backward_fused = !is("DREAMSTAGE_CPU_BACKWARD", "panel");
    s.cpu_mul_mat = !is("DREAMSTAGE_CPU_MUL_MAT", "ggml");
    s.cpu_graph_kernels = !is("DREAMSTAGE_CPU_GRAPH", "ggml");
    s.cuda_train_mmq = is("DREAMSTAGE_CUDA_TRAIN_MMQ", "1");
    s.ce_kernel = !is("DREAMSTAGE_CE_KERNEL", "0");
    const char * lf = std::getenv("DREAMSTAGE_LORA_FUSION");
    s.lora_fusion = lf == nullptr || std::atoi(lf) != 0;
    s.f16_products = !is("DREAMSTAGE_F16_PRODUCTS", "0");
    s.out_prod_fp32 = is("DREAMSTAGE_CUDA_OUT_PROD_MATH", "fp32");
    s.bank_gather = is("DREAMSTAGE_BANK_GATHER", "id")      ? DREAM_BANK_ID
                    : is("DREAMSTAGE_BANK_GATHER", "dense") ? DREAM_BANK_DENSE
                    : is("DREAMSTAGE_BANK_GATHER", "bgmv")  ? DREAM_BANK_BGMV
                                                            : DREAM_BANK_AUTO;
    return s;
}

// This library's registry, read once at its first use (thread-safe: a function-local static).
inline const dream_switches & dream_switches_loaded() {
    static const dream_switches s = dream_switches_read();
    return s;
}

// "NAME=value,..." for every switch, as dream_build_info reports it.
inline std::string dream_switches_describe(const dream_switches & s) {
    static const char * const where[] = { "auto", "host", "device" };
    static const char * const gather[] = { "auto", "id", "dense", "bgmv" };
    char buf[512];
    std::snprintf(buf, sizeof(buf),
                  "NVIDIA_TF32_OVERRIDE=%s,DREAMSTAGE_PROFILE=%d,DREAMSTAGE_OPTIMIZER=%s,DREAMSTAGE_FUSED_ATTN=%d,"
                  "DREAMSTAGE_CPU_BACKWARD=%s,DREAMSTAGE_CPU_MUL_MAT=%s,DREAMSTAGE_CUDA_TRAIN_MMQ=%d,"
                  "DREAMSTAGE_CE_KERNEL=%d,DREAMSTAGE_LORA_FUSION=%d,DREAMSTAGE_F16_PRODUCTS=%d,"
                  "DREAMSTAGE_CUDA_OUT_PROD_MATH=%s,DREAMSTAGE_BANK_GATHER=%s,DREAMSTAGE_CPU_GRAPH=%s",
                  s.fp32_mode ? "0" : "default", s.profile, where[s.optimizer], s.fused_attn ? 1 : 0,
                  s.cpu_backward_fused ? "fused" : "panel", s.cpu_mul_mat ? "batched" : "ggml", s.cuda_train_mmq ? 1 : 0,
                  s.ce_kernel ? 1 : 0, s.lora_fusion ? 1 : 0, s.f16_products ? 1 : 0, s.out_prod_fp32 ? "fp32" : "tf32",
                  gather[s.bank_gather], s.cpu_graph_kernels ? "dream" : "ggml");
    return buf;
}
