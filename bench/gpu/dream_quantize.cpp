// Quantizes a GGUF with the built libllama's own quantizer, so the K-quant
// models of the GPU check and benchmark (Q4_K_M) are made on the device from a
// generated F32/F16 model; the `gguf` Python package has no K-quant quantizer.
// "f32" writes the dequantized twin of a quantized model (every weight expanded
// to F32): the exact-arithmetic reference the GPU check measures quantized runs against.
//   dream_quantize IN.gguf OUT.gguf q4_k_m|q4_k_s|q4_0|q8_0|f32
#include "llama.h"

#include <cstdio>
#include <cstring>
#include <thread>

int main(int argc, char ** argv) {
    if (argc != 4) {
        std::fprintf(stderr, "usage: %s IN.gguf OUT.gguf q4_k_m|q4_k_s|q4_0|q8_0|f32\n", argv[0]);
        return 2;
    }
    static const struct { const char * name; llama_ftype ftype; } known[] = {
        { "q4_k_m", LLAMA_FTYPE_MOSTLY_Q4_K_M }, { "q4_k_s", LLAMA_FTYPE_MOSTLY_Q4_K_S },
        { "q4_0", LLAMA_FTYPE_MOSTLY_Q4_0 }, { "q8_0", LLAMA_FTYPE_MOSTLY_Q8_0 }, { "f32", LLAMA_FTYPE_ALL_F32 },
    };
    llama_model_quantize_params qp = llama_model_quantize_default_params();
    bool found = false;
    for (const auto & k : known) {
        if (std::strcmp(argv[3], k.name) == 0) {
            qp.ftype = k.ftype;
            found = true;
        }
    }
    if (!found) {
        std::fprintf(stderr, "dream_quantize: unknown type '%s'\n", argv[3]);
        return 2;
    }
    qp.nthread = (int) std::thread::hardware_concurrency();
    qp.allow_requantize = qp.ftype == LLAMA_FTYPE_ALL_F32;   // dequantizing is the point of f32
    llama_backend_init();
    const uint32_t rc = llama_model_quantize(argv[1], argv[2], &qp);
    if (rc != 0) {
        std::fprintf(stderr, "dream_quantize: llama_model_quantize failed (%u)\n", rc);
        return 1;
    }
    return 0;
}
