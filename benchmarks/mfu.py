"""Model FLOP utilisation: loracls' achieved model FLOP/s during training against the machine's measured peak.

Peak: this script's own GEMM microbenchmark, square matmuls in fp32 and bf16 (the best of several sizes and
repeats). Achieved: the FLOPs the model needs for the real tokens of the training texts (forward, backward
to the activations and to the LoRA weights), counted with `torch.utils.flop_counter` on unpadded sequences
and fitted as a*L + b*L^2 per text of L tokens, divided by the seconds of a `loracls train` run of one epoch
over those texts, read raw (`min_steps: 0`, `head_init: zero`; the script asserts it saw each text once).
Padding computed inside a batch is not counted as useful work.

Also: the GEMM ceiling of the model's own shapes. The square-matmul peak is not reachable with a hidden size
of 640 and a micro-batch of ~800 tokens; `model_gemm` times the decoder's linear layers at the run's mean
micro-batch of real tokens (forward, and backward to the input: frozen weights need no weight gradient),
each shape weighted by how often the model has it. No model can beat that ceiling with these matmuls.

    python benchmarks/mfu.py [--steps 12] [--precision auto]

Prints the table and writes benchmarks/results/mfu[_<device>].json.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, fitted_flops, write_result  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.lora import apply_lora  # noqa: E402
from loracls.model import load_classifier, load_tokenizer, resolve_model  # noqa: E402
from loracls.training.train import train  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def peak_flops(dtype: torch.dtype, device: torch.device, budget_s: float = 3.0) -> dict:
    """The best FLOP/s of an n x n matmul over sizes that each finish inside the time budget."""
    best = {"flops_per_s": 0.0, "n": None}
    sizes = (1024, 2048, 4096) if device.type == "cpu" else (4096, 8192, 16384)
    for n in sizes:
        a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
        torch.matmul(a, b)  # warm-up: kernels chosen, pages touched
        sync(device)
        start = time.perf_counter()
        torch.matmul(a, b)
        sync(device)
        once = time.perf_counter() - start
        repeats = max(1, min(20, int(budget_s / max(once, 1e-6))))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            torch.matmul(a, b)
            sync(device)
            times.append(time.perf_counter() - start)
        flops = 2 * n**3 / min(times)
        if flops > best["flops_per_s"]:
            best = {"flops_per_s": flops, "n": n}
        if once * 8 > budget_s:  # the next size takes 8x as long: over the budget
            break
    return best


def model_gemm(
    cfg: TrainConfig, labels: list[str], rows: int, dtype: torch.dtype, device: torch.device
) -> dict:
    """FLOP/s of the decoder's linear layers at `rows` tokens: forward and backward to the input."""
    model = load_classifier(resolve_model(cfg.model), labels)
    shapes = Counter(
        tuple(m.weight.shape)
        for m in model.modules()
        if isinstance(m, torch.nn.Linear) and min(m.weight.shape) > len(labels)  # not the head
    )
    del model
    flops = seconds = 0.0
    for (out_features, in_features), count in shapes.items():
        w = torch.randn(out_features, in_features, device=device, dtype=dtype)
        x = torch.randn(rows, in_features, device=device, dtype=dtype)
        dy = torch.randn(rows, out_features, device=device, dtype=dtype)
        best = float("inf")
        for _ in range(6):  # the first is a warm-up that the minimum leaves out
            sync(device)
            start = time.perf_counter()
            torch.nn.functional.linear(x, w)  # forward
            dy @ w  # backward to the input
            sync(device)
            best = min(best, time.perf_counter() - start)
        flops += count * 2 * 2 * rows * in_features * out_features
        seconds += count * best
    return {
        "flops_per_s": flops / seconds,
        "rows": rows,
        "shapes": {f"{o}x{i}": n for (o, i), n in shapes.items()},
    }


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_flops(cfg: TrainConfig, labels: list[str], lengths: list[int]) -> tuple[float, dict]:
    """FLOPs of one forward + backward over texts of these lengths, unpadded: sum of a*L + b*L^2."""
    path = resolve_model(cfg.model)
    model = load_classifier(path, labels, attention="eager")  # attention as matmuls, which are counted
    model, _ = apply_lora(model, cfg)
    model.train()

    def step(ids: torch.Tensor) -> None:
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        logits.float().logsumexp(-1).sum().backward()
        model.zero_grad(set_to_none=True)

    return fitted_flops(step, lengths)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--data", default="zh-reviews")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps of the timed run")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

    peaks = {name: peak_flops(dtype, device) for name, dtype in DTYPES.items() if name != "fp16"}
    if device.type == "cuda":
        peaks["fp16"] = peak_flops(torch.float16, device)
    for name, p in peaks.items():
        print(f"peak {name}: {p['flops_per_s'] / 1e9:.1f} GFLOP/s (n={p['n']})", flush=True)

    with tempfile.TemporaryDirectory() as tmp:
        cfg = TrainConfig(
            model=args.model,
            data=args.data,
            max_train_examples=args.steps * args.batch_size,
            max_eval_examples=32,
            epochs=1,
            min_steps=0,  # one epoch: the FLOPs below are counted for one pass over the texts
            head_init="zero",  # raw texts, whose lengths the FLOPs are counted on (no prompt around them)
            batch_size=args.batch_size,
            eval_every=10**6,
            save_every=10**6,
            log_every=max(1, args.steps // 4),
            baseline=False,
            precision=args.precision,
            out=str(Path(tmp) / "run"),
        )
        _, metrics = train(cfg)
    splits = load_splits(cfg)
    tokenizer = load_tokenizer(resolve_model(cfg.model))
    lengths = [min(len(x), cfg.max_length) for x in tokenizer(list(splits.train["text"]))["input_ids"]]
    assert metrics["train"]["examples_seen"] == len(lengths), "the timed run trained other than one epoch"
    flops, fit = training_flops(cfg, splits.labels, lengths)
    achieved = flops / metrics["train"]["train_s"]
    used = {"no": "fp32", "bf16": "bf16", "fp16": "fp16"}[metrics["train"]["mixed_precision"]]
    mfu = achieved / peaks[used]["flops_per_s"]
    rows = round(metrics["train"]["micro_batch_size"] * np.mean(lengths))
    ceiling = model_gemm(cfg, splits.labels, rows, DTYPES[used], device)
    print(
        f"\nloracls: {metrics['train']['tokens_per_s']:.0f} real tokens/s, {flops / sum(lengths) / 1e9:.3f} "
        f"GFLOP per token (mean length {np.mean(lengths):.0f}) -> {achieved / 1e9:.1f} GFLOP/s achieved"
    )
    print(f"precision {used}: {mfu:.1%} of the measured {used} peak ({peaks[used]['flops_per_s'] / 1e9:.1f})")
    print(
        f"the model's own GEMMs at {rows} rows: {ceiling['flops_per_s'] / 1e9:.1f} GFLOP/s "
        f"({ceiling['flops_per_s'] / peaks[used]['flops_per_s']:.1%} of the square peak); loracls reached "
        f"{achieved / ceiling['flops_per_s']:.1%} of it"
    )
    device_name = "" if device.type == "cpu" else "_" + device.type
    write_result(
        args.out or RESULTS / f"mfu{device_name}.json",
        {
            "question": "loracls' achieved model FLOP/s in training as a share of the measured GEMM peak",
            "baseline": f"measured {used} GEMM peak",
            "peaks": peaks,
            "training": {
                "examples": len(lengths),
                "real_tokens": sum(lengths),
                "mean_length": float(np.mean(lengths)),
                "train_s": metrics["train"]["train_s"],
                "tokens_per_s": metrics["train"]["tokens_per_s"],
                "micro_batch_size": metrics["train"]["micro_batch_size"],
                "precision": used,
                "model_flops": flops,
                "flop_fit": fit,
            },
            "achieved_flops_per_s": achieved,
            "mfu": mfu,
            "model_gemm": ceiling,
            "share_of_model_gemm": achieved / ceiling["flops_per_s"],
        },
    )


if __name__ == "__main__":
    main()
