"""Training throughput: loracls against the write-up's recipe and HF Trainer + PEFT, in one run.

The same model (Gemma 3 270M, head started at zero in every way), the same training examples of a real review
set read as raw texts (one epoch of `--steps` x 16), the same LoRA (r=8, alpha=16, dropout 0.05 on
q_proj/v_proj), the same optimizer (AdamW 2e-4, weight decay 0.01, cosine with 6% warm-up, clipping 1.0) and
the same number of optimizer steps of 16 examples, trained four ways, each in its own process (so peak memory
is its own). loracls' own defaults differ (`head_init: auto` reads each text inside a prompt, `min_steps: 60`
trains more than one epoch of a small set, `lr: 1e-3`): the loracls way sets them to the shared recipe, and
every way asserts that it trained one epoch in `--steps` optimizer steps, so examples/s are the same work.

- `seed`: the write-up's recipe and the baseline: `padding="max_length"` at 256 tokens, batches of 16,
  fp32, a plain loop.
- `hf-default`: `transformers.Trainer` as its documentation starts you off: random batches padded per
  batch by `DataCollatorWithPadding`, default precision (fp32).
- `hf-matched`: Trainer with its best matching settings: `train_sampling_strategy="group_by_length"`,
  dynamic padding, the precision loracls picks.
- `loracls`: `loracls train` with `--precision auto` (validation only at the end, no baseline).
- `loracls-compile` (only when asked for in `--ways`): the same with `--compile`; its compilation happens in
  the first steps and counts as training time. `steady_examples_per_s` (both loracls ways) leaves out the
  first log window, where compilation happens.
- `loracls-random` (only when asked for): loracls with `--length-grouping 1` (random micro-batches, each
  padded to its longest), to see what length grouping does to accuracy.
- `loracls-sorted` (only when asked for): loracls with `balance_labels=false` (micro-batches cut from a plain
  length sort, as before labels were balanced and as Trainer's `group_by_length` does).

The loracls ways also report their micro-batches' padding (padded tokens / real tokens) and label skew (the
mean total-variation distance between a micro-batch's label mix and the training set's; random batches of 16
from a 50/50 set give about 0.1 by chance alone).

Each way is scored on the same validation examples. Examples/s and real tokens/s count the time of the
training steps only (not loading or evaluation).

    python benchmarks/train_throughput.py [--steps 24] [--eval 200] [--ways seed,loracls] [--seed 0]

Prints a table with the ratios and writes benchmarks/results/train_throughput[_<device>].json.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import RESULTS, peak_memory_gb, write_result  # noqa: E402

from loracls.config import TrainConfig  # noqa: E402
from loracls.data.batching import make_loader  # noqa: E402
from loracls.data.splits import load_splits  # noqa: E402
from loracls.data.tokenization import tokenize  # noqa: E402
from loracls.environment.devices import mixed_precision  # noqa: E402
from loracls.model import load_classifier, load_tokenizer, resolve_model  # noqa: E402
from loracls.training.evaluate import predict_probs, score  # noqa: E402

BATCH = 16
MAX_LENGTH = 256
WAYS = ("seed", "hf-default", "hf-matched", "loracls")
EXTRA_WAYS = ("loracls-compile", "loracls-random", "loracls-sorted")


def config(args: argparse.Namespace, out: str | None = None) -> TrainConfig:
    """The loracls run; its data, LoRA and optimizer settings are the ones every way uses."""
    return TrainConfig(
        model=args.model,
        data=args.data,
        max_train_examples=args.steps * BATCH,
        max_eval_examples=args.eval,
        max_length=MAX_LENGTH,
        epochs=1,
        min_steps=0,  # exactly the one epoch every way trains
        lr=2e-4,
        head_init="zero",  # raw texts, no prompt, as the other ways read them
        batch_size=BATCH,
        warmup_steps=round(0.06 * args.steps),
        eval_every=10**6,
        log_every=max(1, args.steps // 4),
        save_every=10**6,
        baseline=False,
        precision=args.precision,
        seed=args.seed,
        out=out,
    )


def batch_mix(cfg: TrainConfig, train_set) -> dict:
    """Padding and label skew of the training micro-batches the run's loader gives (its first epoch)."""
    loader = make_loader(
        train_set,
        None,
        cfg.micro_batch_size or BATCH,
        True,
        cfg.seed,
        None,
        cfg.length_grouping,
        cfg.balance_labels,
    )
    lengths, labels = [len(x) for x in train_set["input_ids"]], train_set["labels"]
    overall = Counter(labels)
    padded = skew = 0.0
    batches = list(loader.batch_sampler)
    for batch in batches:
        padded += max(lengths[i] for i in batch) * len(batch)
        mix = Counter(labels[i] for i in batch)
        skew += sum(abs(mix[y] / len(batch) - n / len(labels)) for y, n in overall.items()) / 2
    return {"padded_per_real_token": padded / sum(lengths), "label_skew": skew / len(batches)}


def peft_model(cfg: TrainConfig, labels: list[str], tokenizer):
    """The base classifier (head at zero, as loracls starts it) with LoRA as the write-up configures it."""
    from peft import LoraConfig, get_peft_model

    model = load_classifier(resolve_model(cfg.model), labels, head_init=cfg.head_init)
    model.config.pad_token_id = tokenizer.pad_token_id
    lora = LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=["q_proj", "v_proj"],
        bias="none",
        task_type="SEQ_CLS",
    )
    return get_peft_model(model, lora)


def run_seed(cfg: TrainConfig, splits, tokenizer, device: torch.device) -> tuple[object, float, int]:
    """The write-up's loop: every text padded to 256 tokens, batches of 16, fp32."""
    from torch.optim import AdamW
    from torch.utils.data import DataLoader, TensorDataset
    from transformers import get_cosine_schedule_with_warmup

    model = peft_model(cfg, splits.labels, tokenizer).to(device)
    encoded = tokenizer(
        list(splits.train["text"]),
        truncation=True,
        max_length=MAX_LENGTH,
        padding="max_length",
        return_tensors="pt",
    )
    labels = torch.tensor([splits.label2id[x] for x in splits.train["label"]])
    dataset = TensorDataset(encoded["input_ids"], encoded["attention_mask"], labels)
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(0))
    optimizer = AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, cfg.warmup_steps, len(loader))
    model.train()
    start = time.perf_counter()
    for input_ids, attention_mask, y in loader:
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": y}
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    synchronize(device)
    return model, time.perf_counter() - start, len(loader)


def run_trainer(
    cfg: TrainConfig, splits, tokenizer, device: torch.device, matched: bool, out: str
) -> tuple[object, float, int]:
    """HF Trainer + PEFT: documentation defaults, or its best settings matching loracls (`matched`)."""
    from transformers import DataCollatorWithPadding, Trainer, TrainingArguments

    model = peft_model(cfg, splits.labels, tokenizer)
    precision = mixed_precision(cfg.precision, device.type) if matched else "no"
    args = TrainingArguments(
        output_dir=out,
        per_device_train_batch_size=BATCH,
        max_steps=math.ceil(len(splits.train) / BATCH),
        learning_rate=cfg.lr,
        weight_decay=cfg.weight_decay,
        lr_scheduler_type="cosine",
        warmup_steps=cfg.warmup_steps,
        max_grad_norm=cfg.max_grad_norm,
        train_sampling_strategy="group_by_length" if matched else "random",
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=device.type == "cpu",
        logging_strategy="no",
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=cfg.seed,
    )
    train_set = tokenize(splits.train, tokenizer, MAX_LENGTH, splits.label2id)
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train_set,
        data_collator=DataCollatorWithPadding(tokenizer),
    )
    start = time.perf_counter()
    trainer.train()
    synchronize(device)
    return trainer.model, time.perf_counter() - start, trainer.state.global_step


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def child(args: argparse.Namespace) -> dict:
    """One way, in this process: train, time, score the validation examples."""
    from loracls.training.train import train

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config(args, out=str(Path(tmp) / "run"))
        splits = load_splits(cfg)
        tokenizer = load_tokenizer(resolve_model(cfg.model))
        real_tokens = sum(min(len(x), MAX_LENGTH) for x in tokenizer(list(splits.train["text"]))["input_ids"])
        steady, mix = None, {}
        if args.way.startswith("loracls"):
            cfg.compile = args.way == "loracls-compile"
            cfg.length_grouping = 1 if args.way == "loracls-random" else cfg.length_grouping
            cfg.balance_labels = args.way != "loracls-sorted"
            mix = batch_mix(cfg, tokenize(splits.train, tokenizer, MAX_LENGTH, splits.label2id))
            run, metrics = train(cfg)
            train_s, val = metrics["train"]["train_s"], metrics["best_val"]
            steps = metrics["train"]["optimizer_steps"]
            assert metrics["train"]["examples_seen"] == len(splits.train), metrics["train"]
            precision = metrics["train"]["mixed_precision"]
            log = [json.loads(line) for line in run.file("train_log.jsonl").read_text().splitlines()]
            logged = [r for r in log if r["kind"] == "train"]
            # examples of each log window after the first, and their seconds
            counts = [(r["step"] - before["step"]) * BATCH for before, r in pairwise(logged)]
            seconds = sum(n / r["examples_per_s"] for n, r in zip(counts, logged[1:], strict=True))
            steady = sum(counts) / seconds if counts else None
        else:
            if args.way == "seed":
                model, train_s, steps = run_seed(cfg, splits, tokenizer, device)
                precision = "no"
            else:
                matched = args.way == "hf-matched"
                model, train_s, steps = run_trainer(cfg, splits, tokenizer, device, matched, tmp)
                precision = mixed_precision(cfg.precision, device.type) if matched else "no"
            val_set = tokenize(splits.val, tokenizer, MAX_LENGTH, splits.label2id)
            probs = predict_probs(model, val_set, tokenizer, 2 * BATCH, device)
            val = score(splits.val, probs, splits.labels)
    examples = len(splits.train)
    # the same work in every way: one epoch of these examples in ceil(examples / 16) optimizer steps
    assert steps == math.ceil(examples / BATCH), f"{args.way} trained {steps} steps, not one epoch"
    return {
        "way": args.way,
        "precision": precision,
        "optimizer_steps": steps,
        "examples": examples,
        "real_tokens": real_tokens,
        "padded_share_seed": 1 - real_tokens / (examples * MAX_LENGTH),
        "train_s": train_s,
        "examples_per_s": examples / train_s,
        "steady_examples_per_s": steady,
        "tokens_per_s": real_tokens / train_s,
        "peak_memory_gb": peak_memory_gb(device),
        "val_examples": len(splits.val),
        "val_accuracy": val["accuracy"],
        "val_macro_f1": val["macro_f1"],
        **mix,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--data", default="zh-reviews")
    parser.add_argument("--steps", type=int, default=24, help="optimizer steps of 16 examples (one epoch)")
    parser.add_argument("--eval", type=int, default=200, help="validation examples")
    parser.add_argument("--precision", default="auto", help="loracls' --precision (and hf-matched's)")
    parser.add_argument("--seed", type=int, default=0, help="every way's seed (data split, order, LoRA init)")
    parser.add_argument("--ways", default=",".join(WAYS))
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--way", choices=WAYS + EXTRA_WAYS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.way:
        args.child_out.write_text(json.dumps(child(args)))
        return

    results = {}
    for way in args.ways.split(","):
        with tempfile.NamedTemporaryFile(suffix=".json") as out:
            command = [sys.executable, __file__, "--way", way, "--child-out", out.name]
            command += ["--model", args.model, "--data", args.data, "--steps", str(args.steps)]
            command += ["--eval", str(args.eval), "--precision", args.precision, "--seed", str(args.seed)]
            subprocess.run(command, check=True)
            results[way] = json.loads(Path(out.name).read_text())
        r = results[way]
        print(
            f"{way}: {r['examples_per_s']:.2f} examples/s, val accuracy {r['val_accuracy']:.3f}", flush=True
        )

    print(
        f"\n{'way':12} {'precision':>9} {'ex/s':>8} {'tok/s':>8} {'peak GB':>8} {'val acc':>8} {'train s':>8}"
    )
    for way, r in results.items():
        print(
            f"{way:12} {r['precision']:>9} {r['examples_per_s']:>8.2f} {r['tokens_per_s']:>8.0f} "
            f"{r['peak_memory_gb']:>8.2f} {r['val_accuracy']:>8.3f} {r['train_s']:>8.1f}"
        )
    ratios = {}
    if "loracls" in results:
        for base in (w for w in results if w not in ("loracls", *EXTRA_WAYS)):
            speed = results["loracls"]["examples_per_s"] / results[base]["examples_per_s"]
            gap = results["loracls"]["val_accuracy"] - results[base]["val_accuracy"]
            ratios[f"loracls/{base}"] = {"speed": speed, "val_accuracy_gap": gap}
            print(f"loracls / {base}: {speed:.2f}x examples/s, val accuracy {gap:+.3f}")
    for way in (w for w in EXTRA_WAYS if "loracls" in results and w in results):
        ours, other = results["loracls"], results[way]
        ratios[f"{way}/loracls"] = {
            "speed": other["examples_per_s"] / ours["examples_per_s"],
            "steady_speed": other["steady_examples_per_s"] / ours["steady_examples_per_s"],
            "val_accuracy_gap": other["val_accuracy"] - ours["val_accuracy"],
        }
        print(
            f"{way} / loracls: "
            + "{speed:.2f}x examples/s, {steady_speed:.2f}x after the first log "
            "window, val accuracy {val_accuracy_gap:+.3f}".format(**ratios[f"{way}/loracls"])
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = args.out or RESULTS / f"train_throughput{'' if device == 'cpu' else '_' + device}.json"
    write_result(
        out,
        {
            "question": "training examples/s of loracls vs the write-up's recipe and HF Trainer + PEFT"
            if "seed" in results
            else f"training examples/s of {', '.join(results)}",
            "baseline": "seed" if "seed" in results else next(iter(results)),
            "settings": {
                "model": args.model,
                "data": args.data,
                "batch": BATCH,
                "max_length": MAX_LENGTH,
                "optimizer_steps": args.steps,
                "precision": args.precision,
                "seed": args.seed,
            },
            "ways": results,
            "ratios": ratios,
        },
    )


if __name__ == "__main__":
    main()
