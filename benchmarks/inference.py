"""Inference throughput: `loracls predict` against `transformers.pipeline("text-classification")`, and on a
CPU its int8 path (`--int8`) against fp32.

Both classify the same texts with the same exported model (a short `loracls train` run, merged and exported
with `loracls export`; the speed of a forward pass does not depend on how long it was trained). Baseline: the
pipeline as its documentation calls it (one text at a time); also shown batched (`batch_size=32`), which is
the fairest pipeline. loracls sorts the texts by length, pads per batch, runs in inference mode and in the
fastest precision of the device (`precision: auto`). The predicted labels must agree.

The work is the same for every way: the forward FLOPs of the texts, unpadded (counted with
`torch.utils.flop_counter`, fitted as a*L + b*L^2 per text); each way's GFLOP/s is that over its seconds, and
its share of the square-matmul peak of its precision, measured in the same run, says how much faster any way
could go on this machine.

int8 (CPU only; `loracls.inference.int8`): the run's classifier calibrated and checked exactly as `--int8`
does (`measure_int8`: same prediction as fp32 on >= 99% of the test split, accuracy within 0.5 point), then
timed; baseline fp32, and the device's `auto` precision beside it. Every loracls way is timed at its default
batch size and at 8 texts per pass. Give `--run` a trained run (the demo's, `benchmarks/runs/demo-benchmark`)
for accuracies that mean something; without it a 2-step run is made, fine for speed only.

    python benchmarks/inference.py [--texts 500] [--run RUN]

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
from loracls.environment.devices import mixed_precision  # noqa: E402
from loracls.inference.export import export_run  # noqa: E402
from loracls.inference.export_format import read_export_info  # noqa: E402
from loracls.inference.predict import Classifier, measure_int8  # noqa: E402
from loracls.training.runs import RunFolder  # noqa: E402
from loracls.training.train import train  # noqa: E402


def make_run(model: str, data: str, folder: Path) -> Path:
    """A 2-step run."""
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
    return folder / "run"


def make_export(model: str, data: str, folder: Path) -> Path:
    """A 2-step run, merged and exported."""
    return export_run(make_run(model, data, folder), folder / "export")


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
    parser.add_argument("--run", type=Path, default=None, help="a trained run (default: a 2-step run)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from transformers import pipeline

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        run = RunFolder(args.run or make_run(args.model, args.data, Path(tmp)))
        table = run.read_split("test").iloc[: args.texts]
        texts, gold = list(table["text"]), list(table["label"])
        export = export_run(run.path, Path(tmp) / "export")
        classifier = Classifier.load(export, device)
        pipe = pipeline("text-classification", model=str(export), device=device, dtype=torch.float32)
        length = {"truncation": True, "max_length": classifier.max_length}
        default_batch = classifier.batch_size
        loracls_ways = {"loracls": classifier}
        fp32 = Classifier.load(export, device)
        fp32.precision = "fp32"
        loracls_ways["loracls-fp32"] = fp32
        int8_check = None
        if device.type == "cpu":
            quantised = Classifier.from_run(run.path, device, full_precision=True)
            quantised.precision = "fp32"
            int8_check, _ = measure_int8(quantised, run)  # calibrated and compared as --int8 does
            loracls_ways["loracls-int8"] = quantised
            print(f"int8 check: {int8_check}", flush=True)

        def with_batch(way: Classifier, size: int):
            def classify(batch):
                way.batch_size = size
                return [r["label"] for r in way.predict(batch)]

            return classify

        prompt = read_export_info(export)["prompt"]

        def theirs(batch_size):
            def classify(batch):
                if prompt:  # the run's prompt, as the README tells a plain-transformers user to apply it
                    batch = [prompt["prefix"] + text + prompt["suffix"] for text in batch]
                return [r["label"] for r in pipe(batch, batch_size=batch_size, **length)]

            return classify

        ways = {}
        for name, way in loracls_ways.items():
            ways[name] = with_batch(way, default_batch)
            ways[f"{name}@8"] = with_batch(way, 8)
        ways |= {"pipeline": theirs(1), "pipeline-batched": theirs(32)}
        results = {}
        for name, fn in ways.items():
            labels, seconds = timed(fn, texts)
            accuracy = sum(a == b for a, b in zip(labels, gold, strict=True)) / len(texts)
            results[name] = {
                "examples_per_s": len(texts) / seconds,
                "seconds": seconds,
                "accuracy": accuracy,
                "labels": labels,
            }
            print(f"{name}: {len(texts) / seconds:.1f} texts/s, accuracy {accuracy:.4f}", flush=True)
        classifier.batch_size = default_batch

        # the work done, with attention as matmuls so that the counter sees it
        lengths = [len(ids) for ids in classifier.tokenizer(texts, **length)["input_ids"]]
        classifier.model.set_attn_implementation("eager")
        with torch.inference_mode():
            flops, fit = fitted_flops(lambda ids: classifier.model(input_ids=ids.to(device)), lengths)
    ours = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[mixed_precision("auto", device.type)]
    peaks = {p: peak_flops(DTYPES[p], device)["flops_per_s"] for p in {"fp32", ours}}
    for name, r in results.items():
        precision = {"loracls": ours, "loracls@8": ours}.get(name, "int8" if "int8" in name else "fp32")
        peak = "fp32" if precision == "int8" else precision  # no int8 matmul peak is measured
        r |= {"gflops_per_s": flops / r["seconds"] / 1e9, "precision": precision, "share_of": peak}
        r["share_of_peak"] = r["gflops_per_s"] * 1e9 / peaks[peak]
        print(f"{name}: {r['gflops_per_s']:.1f} GFLOP/s = {r['share_of_peak']:.1%} of the {peak} peak")
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
    if "loracls-int8" in results:
        for batch in ("", "@8"):
            for base in ("loracls-fp32", "loracls"):
                key = f"loracls-int8{batch}/{base}{batch}"
                ours_int8, theirs_float = results[f"loracls-int8{batch}"], results[base + batch]
                speed[key] = ours_int8["examples_per_s"] / theirs_float["examples_per_s"]
                print(f"{key}: {speed[key]:.2f}x", flush=True)
    device_name = "" if device.type == "cpu" else "_" + device.type
    write_result(
        args.out or RESULTS / f"inference{device_name}.json",
        {
            "question": "texts/s of loracls predict vs the transformers text-classification pipeline; "
            "int8 vs fp32 on the CPU",
            "baseline": "pipeline (one text at a time, its default); int8: loracls-fp32 at the same batch",
            "run": str(args.run) if args.run else "a 2-step run (speed only)",
            "texts": len(texts),
            "default_batch_size": default_batch,
            "int8_check": int8_check,
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
