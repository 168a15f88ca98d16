"""`dreamstage info`: what this install is and what it runs on."""
from __future__ import annotations

import dreamstage
from dreamstage import default_model as models
from dreamstage import environment, native


def collect() -> dict:
    bi = native.build_info()
    return {
        "dreamstage": dreamstage.__version__,
        "llama_cpp_python_pin": bi["llama-cpp-python"],
        "llama_cpp_commit": bi["upstream"],
        "patches": bi["patches"],
        "switches": bi.get("switches", {}),
        "lib_dir": str(native.lib_dir()),
        # where it is, or where the first `serve` will put it (info never downloads)
        "default_model": str(models.default_model_path()),
        "default_model_cached": models.default_model_path().is_file(),
        "backends": native.backends(),
        "devices": native.devices(),
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
        lines.append(f"  {d['name']:<8} {d['description']}: {d['free'] // mib} MiB free of {d['total'] // mib} MiB")
    for name, value in i["environment"].items():
        lines.append(f"env              {name}={value}")
    return "\n".join(lines)
