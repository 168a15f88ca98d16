// Build identity of the patched libllama and the switches it runs with (see dream_build_info in dream.h).
#include "dream.h"
#include "dream-switches.h"

#include <string>

#ifndef DREAM_PIN_VERSION
#error "DREAM_PIN_VERSION must be set by CMakeLists.txt from vendor/pin.json"
#endif

extern "C" const char * dream_build_info(void) {
    static const std::string info = "dreamstage;llama-cpp-python=" DREAM_PIN_VERSION ";upstream=" DREAM_PIN_COMMIT
                                    ";patches=" DREAM_PATCHES ";switches=" +
                                    dream_switches_describe(dream_switches_loaded());
    return info.c_str();
}
