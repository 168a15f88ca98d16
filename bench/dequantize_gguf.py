"""Write a dequantized copy of a GGUF model (every tensor as F32, or 2-D ones as F16), for
bench_drift_floor.py's question: does the floor under anchors_changed come from the
quantized weights' arithmetic? The copy is a temporary file; never commit it.

    python bench/dequantize_gguf.py SRC.gguf /tmp/DST-f32.gguf f32      # or f16

Uses the `gguf` package (pinned with the test requirements) to read the quantized
blocks (gguf.quants.dequantize) and write the same metadata with file_type changed.
"""
from __future__ import annotations

import argparse

import gguf
import numpy as np
from gguf.quants import dequantize


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("kind", choices=["f32", "f16"])
    args = ap.parse_args()
    r = gguf.GGUFReader(args.src)
    w = gguf.GGUFWriter(args.dst, r.fields[gguf.Keys.General.ARCHITECTURE].contents())
    for f in r.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue                                   # written by GGUFWriter itself
        vt = f.types[0]
        value = f.contents()
        if f.name == gguf.Keys.General.FILE_TYPE:
            value = int(gguf.LlamaFileType.ALL_F32 if args.kind == "f32" else gguf.LlamaFileType.MOSTLY_F16)
        w.add_key_value(f.name, value, vt, sub_type=f.types[-1] if vt == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        a = a.reshape(tuple(int(x) for x in reversed(t.shape.tolist())))
        w.add_tensor(t.name, a.astype(np.float16) if args.kind == "f16" and a.ndim == 2 else a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{args.dst}: {len(r.tensors)} tensors as {args.kind}")


if __name__ == "__main__":
    main()
