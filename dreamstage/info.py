"""`dreamstage info`: what this install is and what it runs on."""
from __future__ import annotations

import dreamstage
from dreamstage import default_model as models
from dreamstage import environment, native
from dreamstage.native import ggml_registry
from dreamstage.serving.resident import available_bytes


def serving_defaults(path) -> dict:
    """What `serve` gives the model at `path` with its default settings (and DREAMSTAGE_*):
    each slot's context, how it was chosen, and where the sampling defaults come from.
    Maps the GGUF on the host without a context; the plan's devices are serve's."""
    from dreamstage.server.settings import ServerSettings
    from dreamstage.serving.resident import model_meta, plan_context, quiet_native_logs
    from dreamstage.serving.sampling import defaults_source, model_defaults

    cfg = ServerSettings().resident_config()
    lc = native.llama_cpp()
    native.lib()
    quiet_native_logs()
    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    # on the host, memory-mapped: the weights are not read (vocab_only leaves the layers' shapes unset)
    params.n_gpu_layers = 0
    model = lc.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ValueError(f"model file {str(path)!r} could not be read by llama.cpp")
    try:
        def meta(key: str) -> str | None:
            return model_meta(lc, model, key)
        plan = plan_context(lc, model, cfg)
        sampling = model_defaults(meta)
        return {"slots": cfg.n_seq, "kv_type": cfg.kv_type, "context": plan.as_dict(),
                "sampling": {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p,
                             "min_p": sampling.min_p, "repeat_penalty": sampling.repeat_penalty},
                "sampling_source": defaults_source(meta)}
    finally:
        lc.llama_model_free(model)


def collect() -> dict:
    bi = native.build_info()
    cached = models.default_model_path().is_file()
    return {
        "dreamstage": dreamstage.__version__,
        "llama_cpp_python_pin": bi["llama-cpp-python"],
        "llama_cpp_commit": bi["upstream"],
        "patches": bi["patches"],
        "switches": bi.get("switches", {}),
        "lib_dir": str(native.lib_dir()),
        # where it is, or where the first `serve` will put it (info never downloads)
        "default_model": str(models.default_model_path()),
        "default_model_cached": cached,
        "serving": serving_defaults(models.default_model_path()) if cached else None,
        "backends": ggml_registry.backends(),
        "devices": [{**d, "available": available_bytes(d)} for d in ggml_registry.devices()],
        "environment": environment.report(),
    }


def render(i: dict) -> str:
    mib = 1 << 20
    lines = [
        f"dreamstage       {i['dreamstage']}",
        f"llama.cpp        {i['llama_cpp_commit']} (as vendored in llama-cpp-python {i['llama_cpp_python_pin']})",
        f"patches          {', '.join(i['patches']) or '(none)'}",
        f"libraries        {i['lib_dir']}",
        f"default model    {i['default_model']}"
        + ("" if i["default_model_cached"] else " (not fetched yet: the first `serve` downloads 93 MB)"),
        f"native switches  {', '.join(f'{k}={v}' for k, v in i['switches'].items()) or '(none reported)'}",
        f"backends         {', '.join(i['backends'])}",
        "devices:",
    ]
    for d in i["devices"]:
        lines.append(f"  {d['name']:<8} {d['description']}: {d['available'] // mib} MiB available of "
                     f"{d['total'] // mib} MiB")
    serving = i.get("serving")
    if serving:
        c = serving["context"]
        why = {"trained": "the model's trained context",
               "memory": f"cut from the trained {c['n_ctx_train']} so the K/V take at most "
                         f"{c['memory_share']:.0%} of {c['kv_device']}'s {c['available_mib']:.0f} MiB available",
               "ctx": "--ctx" if c["kv_unified"] else "--ctx / parallel"}[c["chosen_by"]]
        s = serving["sampling"]
        shape = (f"{c['slot_ctx']} tokens shared by {serving['slots']} slots (one K/V pool; {why})" if c["kv_unified"]
                 else f"{c['slot_ctx']} tokens per slot x {serving['slots']} slots ({why})")
        lines += [
            f"serve context    {shape}; K/V {c['kv_mib']:.0f} MiB {serving['kv_type']} on {c['kv_device']}",
            f"serve sampling   temperature {s['temperature']:g}, top_k {s['top_k']}, top_p {s['top_p']:g}, "
            f"min_p {s['min_p']:g}, repeat_penalty {s['repeat_penalty']:g}: {serving['sampling_source']}",
        ]
    for name, value in i["environment"].items():
        lines.append(f"env              {name}={value}")
    return "\n".join(lines)
