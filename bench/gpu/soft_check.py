"""tests/test_soft_targets.py's checks on whatever device the resident offloads to.

    PYTHONPATH=SITE:tests LLAMA_CPP_LIB_PATH=BUILD/bin NVIDIA_TF32_OVERRIDE=0 \
        python3 bench/gpu/soft_check.py .gpu/tiny-llama-f32-s1234.gguf

The regularizer's default rehearsal trains soft targets (dream_window_soft_targets):
on a CUDA build the label rows are filled on the host into the device's label
matrix, a path the CPU tests never take. This loads the tiny model with every
layer offloaded (ResidentConfig's n_gpu_layers -1) and calls the test module's
functions with it: the loss and the whole LoRA gradient against the float64
NumPy reference (one chunk and three; rows that sum to 1 and rows that leave
a rest, whose loss nodes the scheduler runs on the host), the model's own
truncated distribution as a stationary target, one-hot soft rows against the
one-hot labels, and the refusals of bad rows. The functions are called directly, so that
the check needs no pytest run (`pytest tests/test_soft_targets.py` passes there too;
docs/architecture/gpu.md, "One libstdc++").
Prints each check's [oracle] line and PASS, or the failure; exit 1 on a failure.
"""
from __future__ import annotations

import sys
import traceback

from dreamstage.serving.resident import ResidentConfig, ResidentModel


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__)
        return 2
    path = sys.argv[1]
    model = ResidentModel(ResidentConfig(model_path=path, n_ctx=256, n_seq=1, n_threads=1, kv_type="f32",
                                         flash_attn="off"))
    import numpy_ref as ref  # tests/, imported after the model is loaded
    import test_soft_targets as t

    tiny_ref = ref.LlamaRef.from_gguf(path)
    checks = [(f"gradient, {name}{', rows with a rest' if rest else ''}",
               lambda c=c, rest=rest: t.test_soft_target_gradient_matches_reference(model, tiny_ref, c, rest))
              for name, c in (("one chunk", 32), ("three chunks", 8)) for rest in (False, True)]
    checks += [("the model's own top k with its rest, stationary",
                lambda: t.test_the_models_own_top_k_with_its_rest_is_a_stationary_target(model, tiny_ref)),
              ("one-hot rows", lambda: t.test_one_hot_soft_targets_give_the_one_hot_gradient(model)),
              ("refusals", lambda: t.test_soft_targets_refuse_bad_input(model))]
    failed = 0
    try:
        for name, check in checks:
            try:
                check()
                print(f"PASS {name}", flush=True)
            except Exception:  # noqa: BLE001 - report every check, then the verdict
                failed += 1
                print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
    finally:
        model.close()
    print("ALL PASS" if not failed else f"{failed} FAILED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
