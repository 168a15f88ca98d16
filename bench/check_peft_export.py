"""Our PEFT export, loaded by Hugging Face's own stack: transformers + peft agree with llama.cpp.

    .venv/bin/python bench/check_peft_export.py --hf-python /path/to/venv/bin/python

The second interpreter has torch, transformers and peft (they are not our
dependencies; e.g. `pip install torch==2.13.0 transformers peft gguf`).

A random rank-8 LoRA on all seven targets of every layer of the default
model is saved as a GGUF LoRA and exported as PEFT by
`dreamstage.adapters.peft.factors_to_peft` (what `GET
/adapters/{name}/versions/{v}?format=peft` returns). llama.cpp decodes a
prompt with and without the GGUF adapter; transformers loads the same GGUF
model and PeftModel loads the export; the model is the default one
dequantized to F32 for both, so neither side rounds the weights or the
activations differently. Compared over every prompt position's logits, as
relative L2:
  base      transformers' base against llama.cpp's: the floor;
  delta     the adapter's change of the logits, transformers + peft against
            llama.cpp: below TOLERANCE when the export is right;
  control   the same with the q/k rows left in llama.cpp's order (the
            rotary reordering skipped): what a wrong export looks like.
Writes bench/results/peft-export-check-<date>.json. Exit 1 when delta is not
below TOLERANCE (and control above it), or the greedy tokens differ.
"""
from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "The adapter learned on a quantized model loads in the Hugging Face stack as well."
# F32 on both sides: what is left is the kernels' summation order (the base floor is
# about 5e-4); a wrong export is off by tens of percent
TOLERANCE = 1e-2
# B's scale: the adapter must move the logits well above the quantization floor
B_STD = 0.1
TARGETS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def dequantized_copy(src: Path, dst: Path) -> Path:
    """`src` with every tensor in F32 (metadata kept): both stacks then multiply the
    same F32 weights, and llama.cpp's F32 products quantize no activations."""
    import gguf

    r = gguf.GGUFReader(str(src))
    arch = r.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, f.contents(), vtype, sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    for t in r.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w.add_tensor(t.name, data.reshape([int(x) for x in reversed(t.shape.tolist())]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def llama_side(work: Path, model_path: Path) -> dict:
    from dreamstage.adapters.files import save_lora
    from dreamstage.adapters.loaded import load_adapter_file
    from dreamstage.adapters.peft import factors_to_peft
    from dreamstage.serving.resident import ResidentConfig, ResidentModel
    from dreamstage.training.drift.decoding import set_context_adapter

    rm = ResidentModel(ResidentConfig(model_path=str(model_path), n_ctx=256, n_seq=1, n_threads=2, kv_type="f32"))
    try:
        lc, model = rm.lc, rm.model
        n_embd, n_head, n_head_kv = rm.n_embd, lc.llama_model_n_head(model), lc.llama_model_n_head_kv(model)
        n_kv = n_embd // n_head * n_head_kv
        n_ff = int(rm.meta("llama.feed_forward_length"))
        dims = {"attn_q": (n_embd, n_embd), "attn_k": (n_embd, n_kv), "attn_v": (n_embd, n_kv),
                "attn_output": (n_embd, n_embd), "ffn_gate": (n_embd, n_ff), "ffn_up": (n_embd, n_ff),
                "ffn_down": (n_ff, n_embd)}
        rng = np.random.default_rng(7)
        rank = 8
        factors = {(layer, t): (rng.normal(0, 1 / np.sqrt(dims[t][0]), (rank, dims[t][0])).astype(np.float32),
                                rng.normal(0, B_STD, (dims[t][1], rank)).astype(np.float32))
                   for layer in range(lc.llama_model_n_layer(model)) for t in TARGETS}
        alpha = 2.0 * rank
        gguf = save_lora(work / "lora.gguf", factors, alpha=alpha, model_arch="llama")
        for name, arch in (("peft", "llama"), ("control", "none")):
            config, blob = factors_to_peft(factors, alpha, arch, n_head, n_head_kv, base_model="SmolLM2-135M")
            d = work / name
            d.mkdir()
            (d / "adapter_config.json").write_text(json.dumps(config))
            (d / "adapter_model.safetensors").write_bytes(blob)
        tokens = rm.tokenize(PROMPT)

        def logits(handle) -> np.ndarray:
            set_context_adapter(rm, handle)
            lc.llama_memory_seq_rm(rm.memory, -1, -1, -1)
            rm.decode_entries([(t, i, 0, True) for i, t in enumerate(tokens)])
            return np.stack([np.ctypeslib.as_array(lc.llama_get_logits_ith(rm.ctx, i), shape=(rm.n_vocab,)).copy()
                             for i in range(len(tokens))])
        base = logits(None)
        handle = load_adapter_file(rm, gguf)
        adapted = logits(handle)
        set_context_adapter(rm, None)
        lc.llama_adapter_lora_free(handle)
        np.savez(work / "llama.npz", tokens=np.array(tokens), base=base, adapted=adapted)
        return {"model_path": str(rm.model_path), "tokens": len(tokens), "rank": rank, "targets": TARGETS}
    finally:
        rm.close()


HF_SIDE = r'''
import json, sys
from pathlib import Path
import numpy as np, torch
from transformers import AutoModelForCausalLM
from peft import PeftModel
model_path, work = Path(sys.argv[1]), Path(sys.argv[2])
ref = np.load(work / "llama.npz")
ids = torch.tensor(ref["tokens"][None, :])
def load():
    return AutoModelForCausalLM.from_pretrained(str(model_path.parent), gguf_file=model_path.name,
                                                torch_dtype=torch.float32).eval()
out = {}
with torch.no_grad():
    base = load()(ids).logits[0].numpy()
    np.save(work / "hf_base.npy", base)
    for name in ("peft", "control"):
        m = PeftModel.from_pretrained(load(), str(work / name)).eval()
        np.save(work / f"hf_{name}.npy", m(ids).logits[0].numpy())
import transformers, peft
print(json.dumps({"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__}))
'''


def rel_l2(x: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x - ref) / np.linalg.norm(ref))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf-python", required=True, help="an interpreter with torch, transformers and peft")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        from dreamstage.default_model import default_model
        quantized = default_model()
        info = {"model": quantized.name, "as": "dequantized to F32 for both stacks",
                **llama_side(work, dequantized_copy(quantized, work / "model-f32.gguf"))}
        model_path = Path(info.pop("model_path"))
        r = subprocess.run([args.hf_python, "-c", HF_SIDE, str(model_path), str(work)],
                           capture_output=True, text=True, timeout=1800)
        if r.returncode != 0:
            sys.exit(f"the Hugging Face side failed:\n{r.stderr[-3000:]}")
        versions = json.loads(r.stdout.strip().splitlines()[-1])
        ref = np.load(work / "llama.npz")
        hf_base = np.load(work / "hf_base.npy")
        delta_ll = ref["adapted"] - ref["base"]
        res = {"base": rel_l2(hf_base, ref["base"]),
               "floor_over_delta": float(np.linalg.norm(hf_base - ref["base"]) / np.linalg.norm(delta_ll))}
        for name in ("peft", "control"):
            hf = np.load(work / f"hf_{name}.npy")
            res[name] = {"delta": rel_l2(hf - hf_base, delta_ll),
                         "greedy_same": float(np.mean(hf.argmax(-1) == ref["adapted"].argmax(-1)))}
    ok = res["peft"]["delta"] < TOLERANCE < res["control"]["delta"] and res["peft"]["greedy_same"] == 1.0
    out = {"bench": "PEFT export loaded by transformers + peft vs llama.cpp", "date": dt.date.today().isoformat(),
           **info, "versions": versions, "tolerance": TOLERANCE,
           "rel_l2": res, "ok": ok}
    dest = ROOT / "bench" / "results" / f"peft-export-check-{out['date']}.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps(out, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
