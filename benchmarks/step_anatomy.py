"""Where a training step's time goes, and what the attention kernel and LoRA dropout cost, in one run.

Gemma 3 270M with LoRA (frozen base as `loracls train` keeps it: `lora.keep_frozen_base`), AdamW steps on
batches of real zh-reviews tokens cut to exactly `L` tokens each (no padding, so every way does the same
work), at each length of `--lengths` with `--rows` tokens a batch (16 x 64, 8 x 128, 2 x 512, ...).

Ways, all in this process, each with its own model, taking turns step by step on the same batches:

- `sdpa, dropout 0.05`: the defaults before this script's figures chose `lora_dropout: 0`, the baseline;
- `eager, dropout 0.05`: attention as two matmuls and a softmax (`--attention eager`);
- `sdpa, dropout 0` and `eager, dropout 0`: LoRA's dropout off (peft then skips it: an identity).

Reports each way's median step time and its speed against the baseline at every length, and for the
baseline at `--profile-length` a `torch.profiler` table of where the step's time goes: matmuls, attention,
casts, element-wise ops (norms, rotary embeddings, GELU, LoRA's scaling), the optimizer, the rest.

    python benchmarks/step_anatomy.py [--lengths 64,128,512] [--rows 1024] [--steps 6] [--precision auto]

Writes benchmarks/results/step_anatomy_<precision>.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, write_result  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.environment.devices import inference_device, mixed_precision  # noqa: E402
from loracls.lora import apply_lora, keep_frozen_base  # noqa: E402
from loracls.model import load_classifier, load_tokenizer, resolve_model  # noqa: E402

WAYS = {
    "sdpa, dropout 0.05": ("sdpa", 0.05),
    "eager, dropout 0.05": ("eager", 0.05),
    "sdpa, dropout 0": ("sdpa", 0.0),
    "eager, dropout 0": ("eager", 0.0),
}
BASELINE = "sdpa, dropout 0.05"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}

KINDS = {  # profiler op name -> what it is; ops not named here count as "other"
    "matmuls": ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm"),
    "attention kernel": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
    "softmax": ("aten::_softmax", "aten::_softmax_backward_data"),
    "casts and copies": ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous"),
    "element-wise": (
        *("aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::pow", "aten::div", "aten::rsqrt"),
        *("aten::neg", "aten::sum", "aten::mean", "aten::cat", "aten::gelu", "aten::gelu_backward"),
        *("aten::tanh", "aten::tanh_backward", "aten::sub", "aten::where", "aten::masked_fill"),
        *("aten::bernoulli_", "aten::native_dropout", "aten::native_dropout_backward", "aten::fill_"),
    ),
    "optimizer": ("aten::_foreach_", "aten::lerp_", "aten::addcmul_", "aten::addcdiv_", "aten::sqrt"),
    "allocation": ("aten::empty", "aten::empty_strided", "aten::zeros", "aten::zero_"),
}


def kind_of(name: str) -> str:
    for kind, names in KINDS.items():
        if name in names or (kind == "attention kernel" and "scaled_dot_product" in name):
            return kind
        if kind == "optimizer" and name.startswith("aten::_foreach_"):
            return kind
    return "other"


def batches(labels_n: int, lengths: list[int], rows: int, steps: int) -> dict[int, list[dict]]:
    """For each length, `steps` batches of real review tokens, each text exactly that long."""
    cfg = TrainConfig(data="zh-reviews")
    splits = load_splits(cfg)
    tokenizer = load_tokenizer(resolve_model(cfg.model))
    stream = [t for ids in tokenizer(list(splits.train["text"][:4000]))["input_ids"] for t in ids[1:]]
    out, at = {}, 0
    for length in lengths:
        per_batch = max(1, rows // length)
        out[length] = []
        for _ in range(steps):
            ids = torch.tensor(stream[at : at + per_batch * (length - 1)]).view(per_batch, length - 1)
            at += per_batch * (length - 1)
            ids = torch.cat([torch.full((per_batch, 1), tokenizer.bos_token_id), ids], dim=1)
            labels = torch.arange(per_batch) % labels_n
            out[length].append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def build(attention: str, dropout: float, labels: list[str], computes: torch.dtype | None, seed: int):
    cfg = TrainConfig(data="zh-reviews", attention=attention, lora_dropout=dropout, seed=seed)
    path = resolve_model(cfg.model)
    torch.manual_seed(seed)
    model = load_classifier(path, labels, attention=attention)
    model.config.pad_token_id = load_tokenizer(path).pad_token_id
    model, _ = apply_lora(model, cfg)
    keep_frozen_base(model, "auto", computes)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    return model, optimizer


def step(model, optimizer, batch: dict, device: torch.device, precision: str) -> float:
    started = time.perf_counter()
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=DTYPES[precision] or torch.float32, enabled=precision != "no"):
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    loss.item()  # waits for the device
    return time.perf_counter() - started


def anatomy(model, optimizer, runs: list[dict], device: torch.device, precision: str) -> dict:
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for batch in runs:
            step(model, optimizer, batch, device, precision)
    seconds: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        if event.key.startswith("aten::"):
            seconds[kind_of(event.key)] += event.self_cpu_time_total / 1e6
    total = sum(seconds.values())
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    return {
        "top_ops": {
            e.key: {"kind": kind_of(e.key), "share": e.self_cpu_time_total / 1e6 / total, "calls": e.count}
            for e in ops
            if e.key.startswith("aten::")
        },
        "per_step_s": {k: v / len(runs) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
        "share": {k: v / total for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])},
        "note": "self CPU time of aten ops under the profiler (which slows a step); shares, not seconds",
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="64,128,512")
    parser.add_argument("--rows", type=int, default=1024, help="tokens a batch")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per way and length")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--precision", default="auto", help="auto, bf16 or no (fp32)")
    parser.add_argument("--profile-length", type=int, default=128)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = inference_device()
    precision = mixed_precision(args.precision, device.type)
    lengths = [int(n) for n in args.lengths.split(",")]
    labels = ["negative", "positive"]
    data = batches(len(labels), lengths, args.rows, args.warmup + args.steps)
    models = {way: build(*spec, labels, DTYPES[precision], seed=0) for way, spec in WAYS.items()}
    times: dict[str, dict[int, list[float]]] = {way: defaultdict(list) for way in WAYS}
    for length in lengths:
        for i, batch in enumerate(data[length]):
            order = list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]
            for way in order:
                seconds = step(*models[way], batch, device, precision)
                if i >= args.warmup:
                    times[way][length].append(seconds)
        print(
            f"length {length}: "
            + ", ".join(f"{way} {statistics.median(times[way][length]):.3f} s" for way in WAYS),
            flush=True,
        )
    results = {}
    for way in WAYS:
        results[way] = {}
        for length in lengths:
            median = statistics.median(times[way][length])
            base = statistics.median(times[BASELINE][length])
            rows = len(data[length][0]["input_ids"]) * length
            results[way][str(length)] = {
                "median_step_s": median,
                "tokens_per_s": rows / median,
                "speed_over_baseline": base / median,
            }
    profiled = data[args.profile_length][args.warmup :]
    parts = anatomy(*models[BASELINE], profiled, device, precision)
    for kind, share in parts["share"].items():
        print(f"{kind:>18}: {share:.1%}")
    for op, facts in parts["top_ops"].items():
        print(f"{op:>48}: {facts['share']:.1%} ({facts['calls']} calls, {facts['kind']})")
    write_result(
        args.out or RESULTS / f"step_anatomy_{precision}.json",
        {
            "question": "what attention's kernel and LoRA dropout cost a training step; where its time goes",
            "baseline": BASELINE,
            "settings": {"rows": args.rows, "lengths": lengths, "steps": args.steps, "precision": precision},
            "ways": results,
            "anatomy": {"way": BASELINE, "length": args.profile_length, **parts},
        },
    )


if __name__ == "__main__":
    main()
