// Build identity of the patched libllama (see dream_build_info in dream.h).
#include "dream.h"

#ifndef DREAM_PIN_VERSION
#error "DREAM_PIN_VERSION must be set by CMakeLists.txt from vendor/pin.json"
#endif

extern "C" const char * dream_build_info(void) {
    return "dreamstage;llama-cpp-python=" DREAM_PIN_VERSION ";upstream=" DREAM_PIN_COMMIT
           ";patches=" DREAM_PATCHES;
}
