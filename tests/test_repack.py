"""The CPU repack trap: weights repacked into an extra buffer type (CPU_REPACK)
have a layout OUT_PROD does not read, so the dream stage refuses to train on
them, naming the weight; loaded without extra buffer types it trains."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from dreamstage.serving.resident import ResidentConfig, ResidentModel
from dreamstage.training.walk.trainer import LoraConfig, Trainer


def _q4_0_copy(src: Path, dst: Path) -> Path:
    """The tiny F32 model with its 2-D block matrices in Q4_0 (repacked on AVX2 CPUs)."""
    import gguf
    from gguf.quants import quantize
    r = gguf.GGUFReader(str(src))
    arch = r.get_field("general.architecture").contents()
    w = gguf.GGUFWriter(str(dst), arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            w.add_array(name, field.contents())
        else:
            w.add_key_value(name, field.contents(), vtype)
    for t in r.tensors:
        data = np.array(t.data, dtype=np.float32).reshape([int(x) for x in reversed(t.shape.tolist())])
        if t.name.startswith("blk.") and data.ndim == 2:
            w.add_tensor(t.name, quantize(data, gguf.GGMLQuantizationType.Q4_0),
                         raw_dtype=gguf.GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(t.name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_repacked_weights_are_refused_naming_the_weight(tiny_model_path, tmp_path):
    path = _q4_0_copy(Path(tiny_model_path), tmp_path / "tiny-q4_0.gguf")
    with ResidentModel(ResidentConfig(model_path=str(path), n_ctx=64, n_seq=1, n_threads=1,
                                      use_extra_bufts=True)) as m:
        try:
            Trainer(m, LoraConfig(targets="attn_q"), window=32, chunk=32).close()
        except ValueError as e:
            assert "blk." in str(e) and "attn_q.weight" in str(e) and "REPACK" in str(e)
        else:
            pytest.skip("this CPU does not repack Q4_0 (no AVX2 8x8 kernel): nothing to refuse")
    with ResidentModel(ResidentConfig(model_path=str(path), n_ctx=64, n_seq=1, n_threads=1)) as m:
        toks = m.tokenize("the plain layout trains")
        with Trainer(m, LoraConfig(targets="attn_q"), window=32, chunk=32) as tr:
            recs = tr.train_window(toks, np.ones(len(toks), np.uint8))
            assert [r.status for r in recs] == ["ok"] and np.linalg.norm(tr.gradients()) > 0
