// dreamstage: the dream stage's C interface.
//
// The dream stage trains a LoRA adapter on the resident llama_context between
// serving's decode batches. Everything here is compiled into our libllama and
// reaches llama.cpp internals; only this header is the contract with Python.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

// Build identity, a static string owned by the library:
// "dreamstage;llama-cpp-python=<version>;upstream=<commit>;patches=<a.patch,b.patch>".
// Its presence proves the loaded libllama is dreamstage's patched build.
LLAMA_API const char * dream_build_info(void);

#ifdef __cplusplus
}
#endif
