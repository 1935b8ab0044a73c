"""Inference throughput: `loracls predict` against `transformers.pipeline("text-classification")`.

Both classify the same texts with the same exported model (a short `loracls train` run, merged and exported
with `loracls export`; the speed of a forward pass does not depend on how long it was trained). Baseline: the
pipeline as its documentation calls it (one text at a time); also shown batched (`batch_size=32`), which is
the fairest pipeline. loracls sorts the texts by length, pads per batch, runs in inference mode and in the
fastest precision of the device (`precision: auto`). The predicted labels must agree.

The work is the same for every way: the forward FLOPs of the texts, unpadded (counted with
`torch.utils.flop_counter`, fitted as a*L + b*L^2 per text); each way's GFLOP/s is that over its seconds, and
its share of the square-matmul peak of its precision, measured in the same run, says how much faster any way
could go on this machine.

    python benchmarks/inference.py [--texts 500] [--export FOLDER]

Prints the table and writes benchmarks/results/inference[_<device>].json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, fitted_flops, write_result  # noqa: E402
from mfu import DTYPES, peak_flops  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data import load_splits  # noqa: E402
from loracls.export import export_run  # noqa: E402
from loracls.predict import Classifier  # noqa: E402
from loracls.sizing import mixed_precision  # noqa: E402
from loracls.train import train  # noqa: E402


def make_export(model: str, data: str, folder: Path) -> Path:
    """A 2-step run, merged and exported."""
    cfg = TrainConfig(
        model=model,
        data=data,
        max_train_examples=32,
        max_eval_examples=16,
        epochs=1,
        min_steps=0,  # the 2 steps of one epoch, not the default's 60
        batch_size=16,
        baseline=False,
        out=str(folder / "run"),
    )
    train(cfg)
    return export_run(folder / "run", folder / "export")


def timed(fn, texts: list[str]) -> tuple[list[str], float]:
    fn(texts[:8])  # warm-up: kernels chosen, weights paged in
    start = time.perf_counter()
    labels = fn(texts)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return labels, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--data", default="zh-reviews")
    parser.add_argument("--texts", type=int, default=500, help="test texts to classify")
    parser.add_argument("--export", type=Path, default=None, help="an existing export (default: make one)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from transformers import pipeline

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    texts = list(load_splits(TrainConfig(data=args.data, max_eval_examples=args.texts)).test["text"])
    with tempfile.TemporaryDirectory() as tmp:
        export = args.export or make_export(args.model, args.data, Path(tmp))
        classifier = Classifier.load(export, device)
        pipe = pipeline("text-classification", model=str(export), device=device, dtype=torch.float32)
        length = {"truncation": True, "max_length": classifier.max_length}

        def ours(batch):
            return [r["label"] for r in classifier.predict(batch)]

        def theirs(batch_size):
            return lambda batch: [r["label"] for r in pipe(batch, batch_size=batch_size, **length)]

        results = {}
        for name, fn in (("loracls", ours), ("pipeline", theirs(1)), ("pipeline-batched", theirs(32))):
            labels, seconds = timed(fn, texts)
            results[name] = {"examples_per_s": len(texts) / seconds, "seconds": seconds, "labels": labels}
            print(f"{name}: {len(texts) / seconds:.1f} texts/s", flush=True)

        # the work done, with attention as matmuls so that the counter sees it
        lengths = [len(ids) for ids in classifier.tokenizer(texts, **length)["input_ids"]]
        classifier.model.set_attn_implementation("eager")
        with torch.inference_mode():
            flops, fit = fitted_flops(lambda ids: classifier.model(input_ids=ids.to(device)), lengths)
    ours = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[mixed_precision("auto", device.type)]
    peaks = {p: peak_flops(DTYPES[p], device)["flops_per_s"] for p in {"fp32", ours}}
    for name, r in results.items():
        precision = ours if name == "loracls" else "fp32"
        r |= {"gflops_per_s": flops / r["seconds"] / 1e9, "precision": precision}
        r["share_of_peak"] = r["gflops_per_s"] * 1e9 / peaks[precision]
        print(f"{name}: {r['gflops_per_s']:.1f} GFLOP/s = {r['share_of_peak']:.1%} of the {precision} peak")
    agree = {
        name: sum(a == b for a, b in zip(r["labels"], results["loracls"]["labels"], strict=True)) / len(texts)
        for name, r in results.items()
    }
    speed = {
        f"loracls/{n}": results["loracls"]["examples_per_s"] / results[n]["examples_per_s"]
        for n in results
        if n != "loracls"
    }
    for name in ("pipeline", "pipeline-batched"):
        print(f"loracls / {name}: {speed[f'loracls/{name}']:.2f}x; labels agree on {agree[name]:.1%}")
    device_name = "" if device.type == "cpu" else "_" + device.type
    write_result(
        args.out or RESULTS / f"inference{device_name}.json",
        {
            "question": "texts/s of loracls predict vs the transformers text-classification pipeline",
            "baseline": "pipeline (one text at a time, its default)",
            "texts": len(texts),
            "loracls_precision": mixed_precision("auto", device.type),
            "ways": {n: {k: v for k, v in r.items() if k != "labels"} for n, r in results.items()},
            "forward_flops": flops,
            "mean_tokens": sum(lengths) / len(lengths),
            "flop_fit": fit,
            "peaks": peaks,
            "ratios": speed,
            "label_agreement_with_loracls": agree,
        },
    )


if __name__ == "__main__":
    main()
