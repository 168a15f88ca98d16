// The tag that marks a GGML_OP_CUSTOM node as one of ours (dream-hooks.h): the
// op kinds of dream-glu.cpp, dream-soft.cpp and dream-bank.cpp set and test it,
// and ggml-cuda reads it to claim the node (patch 0108).
#include "dream-stage.h"

#include "ggml-impl.h"   // ggml_get_op_params_i32, ggml_set_op_params_i32

ggml_tensor * dream_custom_tagged(ggml_tensor * node, int32_t kind) {
    ggml_set_op_params_i32(node, DREAM_CUSTOM_TAG_PARAM, DREAM_CUSTOM_TAG);
    ggml_set_op_params_i32(node, DREAM_CUSTOM_TAG_PARAM + 1, kind);
    return node;
}

bool dream_is_custom(const ggml_tensor * t, int32_t kind) {
    return t->op == GGML_OP_CUSTOM && ggml_get_op_params_i32(t, DREAM_CUSTOM_TAG_PARAM) == DREAM_CUSTOM_TAG &&
           ggml_get_op_params_i32(t, DREAM_CUSTOM_TAG_PARAM + 1) == kind;
}
