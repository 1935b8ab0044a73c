"""Which precision is fastest for inference on this CPU: fp32, bf16 or int8 (`--int8`)?

`--precision auto` picks bf16 only on CPUs with AVX-512-BF16 or AMX (`loracls.environment.cpu`), and
`--int8` runs only where `torch._int_mm` has int8 dot-product instructions (AVX-512-VNNI, AVX-VNNI or AMX:
`loracls.environment.cpu`); elsewhere both are emulated. This script measures what those rules stand on,
on the machine it runs on. Baseline: fp32, measured in the same run.

1. The decoder's own matmuls (Gemma 3 270M's linear-layer shapes, each weighted by how often the model has
   it, at `--rows` tokens: a batch of short texts): fp32 `a @ b`, bf16 `a @ b`, int8 `torch._int_mm` (what
   `--int8` runs), and torch's dynamic int8 linear (`quantize_dynamic`, fbgemm: one activation range per
   tensor, which changed 22% of the demo classifier's labels; for comparison only).
2. The whole classifier's forward pass on the same `--texts` zh reviews in batches of 8: fp32, bf16
   autocast, and int8 (`loracls.inference.int8.quantize`, calibrated on the same texts: speed only, no
   accuracy).

    python benchmarks/cpu_precisions.py [--rows 512] [--texts 16] [--out FILE_OR_FOLDER]

Prints the ratios and writes benchmarks/results/cpu_precisions_<kind>.json, the kind named after the CPU's
best flag (amx, avx512-bf16, avx512-vnni, avx-vnni, avx2).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_result  # noqa: E402

from loracls.data.tables import read_builtin  # noqa: E402
from loracls.environment.cpu import cpu_flags, cpu_has_fast_bf16, cpu_has_fast_int8  # noqa: E402
from loracls.environment.devices import mixed_precision  # noqa: E402
from loracls.inference import int8  # noqa: E402
from loracls.model import load_classifier, load_tokenizer, resolve_model  # noqa: E402


def best_seconds(fn, budget_s: float, at_most: int = 20) -> float:
    """The fastest of repeated calls, after one warm-up, within about `budget_s`."""
    start = time.perf_counter()
    fn()
    once = time.perf_counter() - start
    times = []
    for _ in range(max(1, min(at_most, int(budget_s / max(once, 1e-6))))):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def matmul_gflops(shapes: Counter, rows: int, budget_s: float) -> dict[str, float]:
    """GFLOP/s of `rows` x in @ (in x out) over the model's shapes (weighted by count), per precision."""
    results = {}
    for precision in ("fp32", "bf16", "int8", "fbgemm"):
        seconds = flops = 0.0
        for (out_features, in_features), count in shapes.items():
            if precision == "fbgemm":  # torch's dynamic int8 linear: one activation range per tensor
                linear = torch.ao.quantization.quantize_dynamic(
                    torch.nn.Sequential(torch.nn.Linear(in_features, out_features, bias=False)),
                    {torch.nn.Linear},
                    dtype=torch.qint8,
                )
                x = torch.randn(rows, in_features)
                fn = lambda linear=linear, x=x: linear(x)  # noqa: E731
            elif precision == "int8":
                a = torch.randint(-127, 128, (rows, in_features), dtype=torch.int8)
                b = torch.randint(-127, 128, (in_features, out_features), dtype=torch.int8)
                fn = lambda a=a, b=b: torch._int_mm(a, b)  # noqa: E731
            else:
                dtype = torch.float32 if precision == "fp32" else torch.bfloat16
                a, b = (
                    torch.randn(rows, in_features, dtype=dtype),
                    torch.randn(in_features, out_features, dtype=dtype),
                )
                fn = lambda a=a, b=b: a @ b  # noqa: E731
            seconds += count * best_seconds(fn, budget_s)
            flops += count * 2 * rows * in_features * out_features
        results[precision] = flops / seconds / 1e9
        print(f"matmuls at {rows} rows, {precision}: {results[precision]:.1f} GFLOP/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--rows", type=int, default=512, help="tokens per matmul (a batch of short texts)")
    parser.add_argument("--texts", type=int, default=16, help="zh reviews per forward-pass measurement")
    parser.add_argument("--budget", type=float, default=1.0, help="seconds per matmul shape and precision")
    parser.add_argument("--out", type=Path, default=None, help="a file, or a folder for the default name")
    args = parser.parse_args()
    torch.manual_seed(0)

    path = resolve_model(args.model)
    model = load_classifier(path, ["negative", "positive"]).float().eval()
    tokenizer = load_tokenizer(path)
    shapes = Counter(tuple(model.get_submodule(name).weight.shape) for name in int8.quantized_names(model))
    matmuls = matmul_gflops(shapes, args.rows, args.budget)

    texts = list(read_builtin("zh-reviews").sample(args.texts, random_state=0)["text"])
    batches = [
        tokenizer(texts[i : i + 8], padding=True, truncation=True, max_length=64, return_tensors="pt")
        for i in range(0, len(texts), 8)
    ]

    @torch.inference_mode()
    def forward_all(dtype: torch.dtype | None = None) -> None:
        for batch in batches:
            if dtype is None:
                model(**batch)
            else:
                with torch.autocast("cpu", dtype=dtype):
                    model(**batch)

    forward = {}
    for precision, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        forward[precision] = len(texts) / best_seconds(lambda dtype=dtype: forward_all(dtype), 0, 1)
        print(f"forward pass, {precision}: {forward[precision]:.2f} texts/s", flush=True)
    int8.quantize(model, int8.input_ranges(model, forward_all))
    forward["int8"] = len(texts) / best_seconds(forward_all, 0, 1)
    print(f"forward pass, int8: {forward['int8']:.2f} texts/s", flush=True)

    ratios = {
        f"{kind}/{p}/fp32": table[p] / table["fp32"]
        for kind, table in (("matmul", matmuls), ("forward", forward))
        for p in ("bf16", "int8", "fbgemm")
        if p in table
    }
    for name, ratio in ratios.items():
        print(f"{name}: {ratio:.3f}x")
    flags = cpu_flags()
    kind = next(
        (
            name
            for flag, name in (
                ("amx_bf16", "amx"),
                ("avx512_bf16", "avx512-bf16"),
                ("avx512_vnni", "avx512-vnni"),
                ("avx_vnni", "avx-vnni"),
                ("avx2", "avx2"),
            )
            if flag in flags
        ),
        "other",
    )
    out = args.out or RESULTS
    write_result(
        out / f"cpu_precisions_{kind}.json" if out.is_dir() else out,
        {
            "question": "matmul GFLOP/s and classifier texts/s in fp32, bf16 and int8 on this CPU",
            "baseline": "fp32, same shapes and texts, same run",
            "model": args.model,
            "rows": args.rows,
            "texts": len(texts),
            "shapes": {f"{o}x{i}": n for (o, i), n in shapes.items()},
            "matmul_gflops_per_s": matmuls,
            "forward_texts_per_s": forward,
            "ratios": ratios,
            "loracls_auto_precision": mixed_precision("auto", "cpu"),
            "cpu_has_fast_bf16": cpu_has_fast_bf16(),
            "cpu_has_fast_int8": cpu_has_fast_int8(),
            "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        },
    )


if __name__ == "__main__":
    main()
