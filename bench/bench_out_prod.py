#!/usr/bin/env python3
"""How much does OUT_PROD with a quantized weight cost on CUDA, against upstream's
F32 OUT_PROD on weights expanded ahead of time?

Shape: the dL/dx product of a 2048 -> 8192 projection over 512 tokens
(out_prod(W, dy^T), W 2048 x 8192), for Q4_0, Q4_1, Q8_0, Q4_K, Q6_K and F16.
Each process start times both ops in A B B A order per round
(tests/native/out_prod_check.cpp --timing-only --bench); processes alternate the
quantized op's cuBLAS math (tf32, the default, and fp32) in A B B A order too.
Writes JSON: per type and math mode, the median ratio quantized/F32 over every
round of every process, with its min and max, and the median milliseconds.

Needs a CUDA build (LLAMA_CPP_LIB_PATH pointing at it) and a GPU.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "native"))
import out_prod_build  # noqa: E402


def run_once(binary: Path, math: str, rounds: int, workdir: Path, tag: str) -> dict:
    report = workdir / f"{tag}.json"
    env = dict(os.environ)
    if math == "fp32":
        env["DREAMSTAGE_CUDA_OUT_PROD_MATH"] = "fp32"
    else:
        env.pop("DREAMSTAGE_CUDA_OUT_PROD_MATH", None)
    r = subprocess.run([str(binary), "--timing-only", "--bench", str(rounds), "--json", str(report)],
                       capture_output=True, text=True, env=env, timeout=600)
    if r.returncode != 0:
        raise RuntimeError(f"{binary} ({math}) failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    result = json.loads(report.read_text())
    if not result["gpu"]:
        raise RuntimeError("no GPU backend in this build or on this machine")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--processes", type=int, default=4, help="process starts per math mode")
    ap.add_argument("--rounds", type=int, default=7, help="A B B A rounds per process")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "out_prod_cuda.json")
    args = ap.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        binary = out_prod_build.build_out_prod_check(work / "out_prod_check")
        runs: list[tuple[str, dict]] = []
        for p in range(args.processes):
            order = ("tf32", "fp32") if p % 2 == 0 else ("fp32", "tf32")
            for math in order:
                runs.append((math, run_once(binary, math, args.rounds, work, f"{p}-{math}")))

    gpu = runs[0][1]["gpu"]
    table = []
    for math in ("tf32", "fp32"):
        per_case: dict[str, list[dict]] = {}
        for m, result in runs:
            if m == math:
                for row in result["bench"]:
                    per_case.setdefault(row["case"], []).append(row)
        for case, rows in per_case.items():
            # each process reports the median of its rounds; pool those medians
            ratios = [r["ratio_median"] for r in rows]
            table.append({
                "case": case,
                "math": math,
                "processes": len(rows),
                "quant_ms_median": statistics.median(r["quant_ms_median"] for r in rows),
                "f32_ms_median": statistics.median(r["f32_ms_median"] for r in rows),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(r["ratio_min"] for r in rows),
                "ratio_max": max(r["ratio_max"] for r in rows),
            })
    out = {
        "question": "quantized OUT_PROD on CUDA vs upstream F32 OUT_PROD on pre-expanded weights",
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "gpu": gpu,
        "shape": "W 2048 x 8192, dy^T 512 tokens -> dst 2048 x 512",
        "processes_per_math": args.processes,
        "rounds_per_process": args.rounds,
        "baseline": "upstream F32 OUT_PROD (cuBLAS SGEMM, TF32 handle) on the host-expanded weights",
        "rows": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    for row in table:
        print(f"{row['case']:<28} {row['math']}  quantized {row['quant_ms_median']:.3f} ms  "
              f"f32 {row['f32_ms_median']:.3f} ms  ratio {row['ratio_median']:.3f} "
              f"[{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
