"""The frozen base under bf16 autocast: stored in fp32 (loracls today) against stored in bf16, in one run.

Gemma 3 270M with LoRA, trained on the same micro-batches of real reviews (zh-reviews, length-grouped as
loracls groups them, at most `--max-length` tokens) under bf16 autocast, three ways, each in its own process
so its peak memory is its own, the ways taking turns `--rounds` times:

- `fp32-base` (the baseline; what `loracls train` does): every weight in fp32; autocast casts each frozen
  linear weight to bf16 on every forward and keeps the copy for the backward.
- `bf16-linears`: the decoder layers' frozen linear weights stored in bf16 (`lora.frozen_linears_in`);
  embeddings, norms, LoRA and the head in fp32. Autocast computes exactly the same numbers, so its losses
  must equal the baseline's to the last bit: the script asserts it.
- `bf16-base`: every frozen weight in bf16, embeddings and norms too (peft's, torchtune's and litgpt's way);
  LoRA and the head in fp32. Its residual stream starts in bf16, so its losses differ: the script reports
  by how much.

Each way runs AdamW steps (forward, backward, optimizer) on `--steps` micro-batches after `--warmup`
untimed ones. Reports the median step time, real tokens/s, the peak resident memory (on a GPU, the peak
allocated) and the weights' bytes, with the ratios against `fp32-base`. Needs a device that computes bf16
(a GPU, or a CPU with AVX-512-BF16 or AMX); elsewhere bf16 is emulated and the comparison says nothing.

    python benchmarks/frozen_base.py [--targets attn-qv] [--steps 12] [--rounds 2] [--out FILE]

`--train N`: instead, whole `loracls train` runs on N zh-reviews (defaults but `--head-init zero
--no-baseline`, 200 validation and test examples), `--frozen-base auto` (bf16 linears where autocast is
bf16) against `--frozen-base fp32` (the baseline), in turns: training examples/s from each run's
metrics.json, the process's peak resident memory, test accuracy. Writes results/frozen_base_train.json.

Writes benchmarks/results/frozen_base_<targets>.json (or `--out`). On a device without bf16 it says so and
writes nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, peak_memory_gb, write_result  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.batching import make_loader  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.data.tokenization import tokenize  # noqa: E402
from loracls.environment.devices import inference_device, mixed_precision  # noqa: E402
from loracls.lora import apply_lora, frozen_linears_in  # noqa: E402
from loracls.model import load_classifier, load_tokenizer, resolve_model  # noqa: E402

WAYS = ("fp32-base", "bf16-linears", "bf16-base")
BASELINE = "fp32-base"


def one_way(args: argparse.Namespace) -> dict:
    """Train `args.way` for `args.warmup + args.steps` micro-batches; its timings, memory and losses."""
    device = inference_device()
    cfg = TrainConfig(
        data="zh-reviews", max_length=args.max_length, target_modules=args.targets, lora_dropout=0.0, seed=0
    )
    splits = load_splits(cfg)
    path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(path)
    train_set = tokenize(splits.train, tokenizer, cfg.max_length, splits.label2id)
    loader = make_loader(train_set, tokenizer, args.micro_batch, True, cfg.seed)
    torch.manual_seed(0)
    model = load_classifier(path, splits.labels, mixed_precision="bf16")
    model.config.pad_token_id = tokenizer.pad_token_id
    if args.way == "bf16-base":
        model.to(torch.bfloat16)
    model, _ = apply_lora(model, cfg)
    for parameter in model.parameters():  # LoRA and the head in fp32 in every way
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    cast = frozen_linears_in(model, torch.bfloat16) if args.way == "bf16-linears" else 0
    model.to(device).train()
    weights_gb = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, seconds, tokens = [], [], []
    batches = iter(loader)
    for step in range(args.warmup + args.steps):
        batch = {k: v.to(device) for k, v in next(batches).items()}
        started = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())  # waits for the device
        if step >= args.warmup:
            seconds.append(time.perf_counter() - started)
            tokens.append(int(batch["attention_mask"].sum()))
    return {
        "way": args.way,
        "cast_linears": cast,
        "weights_gb": weights_gb,
        "peak_gb": peak_memory_gb(device),
        "median_step_s": statistics.median(seconds),
        "real_tokens_per_s": sum(tokens) / sum(seconds),
        "losses": losses,
    }


def train_runs(args: argparse.Namespace) -> dict:
    """`loracls train` on `args.train` examples with `--frozen-base auto` and `fp32`, `args.rounds` each."""
    runs: dict[str, list[dict]] = {"auto": [], "fp32": []}
    with tempfile.TemporaryDirectory() as tmp:
        for round_ in range(args.rounds):
            for way in ("fp32", "auto") if round_ % 2 == 0 else ("auto", "fp32"):
                out = Path(tmp) / f"{way}-{round_}"
                command = [
                    *(str(Path(sys.executable).parent / "loracls"), "train", "--data", "zh-reviews"),
                    *(
                        "--out",
                        str(out),
                        "--max-train-examples",
                        str(args.train),
                        "--max-eval-examples",
                        "200",
                    ),
                    *("--head-init", "zero", "--no-baseline", "--frozen-base", way, "--seed", str(round_)),
                ]
                with open(Path(tmp) / "log", "w+") as log:  # a file, not a pipe: a full pipe would block it
                    child = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
                    _, status, usage = os.wait4(child.pid, 0)
                    log.seek(0)
                    assert status == 0, log.read()[-3000:]
                metrics = json.loads((out / "metrics.json").read_text())
                resolved = yaml.safe_load((out / "config.yaml").read_text())["frozen_base"]
                runs[way].append(
                    {
                        "frozen_base": resolved,
                        "examples_per_s": metrics["train"]["examples_per_s"],
                        "train_s": metrics["train"]["train_s"],
                        "peak_rss_gb": usage.ru_maxrss / 2**20,
                        "test_accuracy": metrics["test"]["accuracy"],
                        "seed": round_,
                    }
                )
                print(f"round {round_ + 1} {way} ({resolved}): {runs[way][-1]}", flush=True)
    summary = {
        way: {
            key: statistics.median(r[key] for r in repeats)
            for key in ("examples_per_s", "train_s", "peak_rss_gb", "test_accuracy")
        }
        for way, repeats in runs.items()
    }
    summary["auto"]["speed_over_baseline"] = (
        summary["auto"]["examples_per_s"] / summary["fp32"]["examples_per_s"]
    )
    summary["auto"]["peak_over_baseline"] = summary["auto"]["peak_rss_gb"] / summary["fp32"]["peak_rss_gb"]
    print(json.dumps(summary, indent=1))
    return {"baseline": "fp32", "examples": args.train, "summary": summary, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--targets", default="attn-qv", help="LoRA's target_modules (a preset or names)")
    parser.add_argument("--steps", type=int, default=12, help="timed micro-batches per way and round")
    parser.add_argument("--warmup", type=int, default=2, help="untimed micro-batches first")
    parser.add_argument("--rounds", type=int, default=2, help="times each way runs, in turns")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument(
        "--out", type=Path, help="the result file (default: results/frozen_base_TARGETS.json)"
    )
    parser.add_argument("--train", type=int, help="whole `loracls train` runs on this many examples instead")
    parser.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in a child process
    args = parser.parse_args()
    if args.way:
        print(json.dumps(one_way(args)))
        return
    device = inference_device()
    if mixed_precision("auto", device.type) != "bf16":
        print(f"skipped: this {device.type} does not compute bf16 (auto picks fp32); nothing to compare")
        return
    if args.train:
        write_result(args.out or RESULTS / "frozen_base_train.json", train_runs(args))
        return
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for round_ in range(args.rounds):
        for way in WAYS if round_ % 2 == 0 else WAYS[::-1]:
            child = [sys.executable, __file__, "--way", way, *sys.argv[1:]]
            out = subprocess.run(child, capture_output=True, text=True, check=True).stdout
            runs[way].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {way}: {runs[way][-1]['median_step_s']:.2f} s a step", flush=True)
    base_losses = runs[BASELINE][0]["losses"]
    for run in runs["bf16-linears"] + runs[BASELINE]:
        assert run["losses"] == base_losses, f"{run['way']} computed other numbers: {run['losses']}"
    ways = {}
    for way, repeats in runs.items():
        step = statistics.median(r["median_step_s"] for r in repeats)
        ways[way] = {
            "median_step_s": step,
            "real_tokens_per_s": statistics.median(r["real_tokens_per_s"] for r in repeats),
            "peak_gb": max(r["peak_gb"] for r in repeats),
            "weights_gb": repeats[0]["weights_gb"],
            "cast_linears": repeats[0]["cast_linears"],
            "largest_loss_difference": max(
                abs(a - b) for a, b in zip(repeats[0]["losses"], base_losses, strict=True)
            ),
            "rounds": [{k: r[k] for k in ("median_step_s", "real_tokens_per_s", "peak_gb")} for r in repeats],
        }
    base = ways[BASELINE]
    for way in ways.values():
        way["speed_over_baseline"] = base["median_step_s"] / way["median_step_s"]
        way["peak_over_baseline"] = way["peak_gb"] / base["peak_gb"]
    print(f"\n{'way':14} {'step s':>7} {'speed':>6} {'tok/s':>6} {'peak GB':>8} {'x':>5} weights loss diff")
    for name, w in ways.items():
        print(
            f"{name:14} {w['median_step_s']:7.2f} {w['speed_over_baseline']:5.2f}x "
            f"{w['real_tokens_per_s']:6.0f} "
            f"{w['peak_gb']:8.2f} {w['peak_over_baseline']:4.2f}x {w['weights_gb']:7.2f}G "
            f"{w['largest_loss_difference']:9.2e}"
        )
    write_result(
        args.out or RESULTS / f"frozen_base_{args.targets}.json",
        {
            "baseline": BASELINE,
            "settings": {k: v for k, v in vars(args).items() if k not in ("way", "out")},
            "ways": ways,
        },
    )


if __name__ == "__main__":
    main()
