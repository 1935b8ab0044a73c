"""One short, self-contained run of loracls' GPU paths, for a locked-down GPU box (or, with --cpu, a dry run).

    python3 scripts/gpu_check.py [--out DIR] [--cpu] [--steps N]      # DIR default: $OUT, else gpu-check/

What it needs is what such a box has: Python with torch, transformers, peft, accelerate, typer, rich,
scikit-learn, pandas and matplotlib, no package index and no model hub. loracls runs from `src/` (not
installed); the missing wheels (`datasets`, dill and multiprocess: under 1 MB; the box's own pyarrow) are
unpacked from `.whl/` when present (`bash scripts/gpu_wheels.sh` fills it on a machine with PyPI; carry it
along). The model is Gemma 3 270M's shape with random weights (speed and memory depend on shapes, not
weights) and a one-character-per-token tokenizer; the data is a keyword-decided toy task that a working
training loop learns. Nothing is downloaded.

It records, into DIR/gpu_check.json (and prints): `doctor --json`; a bf16 run whose micro-batch is probed
(throughput, peak memory against `doctor`'s plan); the same run in fp32 (loss curves compared, accuracy);
fp16 with the loss scaler and a forced NaN step (`--skip-nonfinite 1`); gradient checkpointing; QLoRA 4-bit
if bitsandbytes is there (else its refusal); inference throughput; the prompt baseline on the device; the
bf16 GEMM peak and the training runs' share of it (MFU). On a GPU sized for well under 8 minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import subprocess
import sys
import time
import traceback
import zipfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[1]


def prepare_path(out: Path) -> None:
    """Import loracls from src/ and the wheels of `.whl/` (unpacked once into OUT/site)."""
    wheels = sorted((ROOT / ".whl").glob("*.whl"))
    site = out / "site"
    if wheels and not (site / ".done").is_file():
        for wheel in wheels:
            zipfile.ZipFile(wheel).extractall(site)
        (site / ".done").write_text("\n".join(w.name for w in wheels))
    sys.path[:0] = [str(ROOT / "src"), *([str(site)] if wheels else [])]


def toy_table(n: int, seed: int):
    """A learnable two-class task: the label is decided by one word among filler."""
    import pandas as pd

    rng = random.Random(seed)
    words = {"positive": ["good", "great", "love"], "negative": ["bad", "awful", "hate"]}
    filler = ["the", "book", "was", "and", "it", "very", "plot", "story", "long", "read"]
    rows = []
    for i in range(n):
        label = "positive" if i % 2 == 0 else "negative"
        parts = rng.sample(filler, rng.randint(3, 9)) + [rng.choice(words[label])]
        rng.shuffle(parts)
        rows.append({"text": " ".join(parts) + f" #{rng.randint(0, 99999)}", "label": label})
    return pd.DataFrame(rows)


def build_model(folder: Path, tiny: bool) -> int:
    """Save a Gemma 3 270M-shaped causal LM (random weights) and a character tokenizer; returns parameters."""
    import string

    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig, PreTrainedTokenizerFast

    specials = ["<pad>", "<eos>", "<bos>", "<unk>"]
    vocab = {tok: i for i, tok in enumerate(specials + sorted(set(string.printable.strip() + " ")))}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>", unk_token="<unk>"
    )
    if tiny:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2)
        shape |= dict(num_key_value_heads=1, head_dim=32, vocab_size=1024, sliding_window=16)
        shape |= dict(layer_types=["sliding_attention", "full_attention"])
    else:  # google/gemma-3-270m's text config
        shape = dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4)
        shape |= dict(num_key_value_heads=1, head_dim=256, vocab_size=262144, sliding_window=512)
        shape |= dict(layer_types=(["sliding_attention"] * 5 + ["full_attention"]) * 3)
        shape |= dict(rope_local_base_freq=10000.0, query_pre_attn_scalar=256, max_position_embeddings=32768)
    config = Gemma3TextConfig(pad_token_id=0, eos_token_id=1, bos_token_id=2, **shape)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config)
    model.save_pretrained(folder)  # whole, so the random-initialisation guard sees every weight
    tokenizer.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def gemm_peak_tflops(device: str, dtype_name: str, size: int) -> float:
    import torch

    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_name]
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    runs, start = 10, time.perf_counter()
    for _ in range(runs):
        a @ b
    sync(device)
    return 2 * size**3 * runs / (time.perf_counter() - start) / 1e12


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def read_log(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]


def train_run(name: str, out: Path, common: dict, **overrides) -> dict:
    """One `loracls.training.train` run; its throughput, losses, memory (peak and planned) and accuracy."""
    import torch

    from loracls.config import TrainConfig
    from loracls.environment.memory import memory_estimate
    from loracls.training.train import train

    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    cfg = TrainConfig(**{**common, "out": str(out / "runs" / name), **overrides})
    started = time.perf_counter()
    _, metrics = train(cfg)
    log = read_log(Path(cfg.out))
    train_records = [r for r in log if r["kind"] == "train"]
    record = {
        "wall_s": round(time.perf_counter() - started, 1),
        "test_accuracy": metrics["test"]["accuracy"],
        "best_val_accuracy": metrics["best_val"]["accuracy"],
        "train": metrics["train"],
        "losses": [r["loss"] for r in train_records],
        # the logged rates of the second half: the first steps of a 16-bit run on an H200 ran 4x slower
        "steady_examples_per_s": median(
            r["examples_per_s"] for r in train_records[len(train_records) // 2 :]
        ),
        "skipped_steps": [r["step"] for r in log if r["kind"] == "skipped"],
    }
    if torch.cuda.is_available():
        precision = {"bf16": "bf16", "fp16": "fp16"}.get(metrics["train"]["mixed_precision"], "fp32")
        plan = memory_estimate(
            common["model"], metrics["train"]["micro_batch_size"], cfg.max_length, precision
        )
        setup = "qlora" if cfg.quantize else "lora"
        set_up = [r for r in log if r["kind"] == "setup"]
        record["memory"] = {
            # training's peak (fit resets the peak once set up); before: loading, prompt search, probe
            "peak_allocated_gb": round(torch.cuda.max_memory_allocated() / 2**30, 3),
            "setup_peak_allocated_gb": round(set_up[0]["mem_allocated_gb"], 3) if set_up else None,
            "planned_gb": round(plan[setup]["total_gb"], 3),
            "planned": {k: round(v, 3) for k, v in plan[setup].items()},
        }
    return record


def lora_model(model_dir: Path, device: str, bf16_base: bool):
    """The check's classifier with LoRA on all linear layers (no dropout), adapter and head in fp32; the
    frozen base in fp32 as loracls loads it, or cast to bf16."""
    import torch

    from loracls.config import TrainConfig
    from loracls.lora import apply_lora
    from loracls.model import load_classifier

    torch.manual_seed(0)
    model = load_classifier(str(model_dir), ["negative", "positive"], mixed_precision="bf16")
    if bf16_base:
        model.to(torch.bfloat16)
    model, _ = apply_lora(model, TrainConfig(target_modules="all-linear", lora_dropout=0.0))
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.data = parameter.data.float()
    return model.to(device).train()


def train_step(model, device: str, dtype, ids, labels) -> None:
    """Forward (under autocast to `dtype`, None: none) and backward, waited for."""
    import torch

    with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
        loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    sync(device)


def step_batch(device: str, rows: int, length: int):
    import torch

    return torch.randint(4, 90, (rows, length), device=device), torch.randint(0, 2, (rows,), device=device)


def time_step(model, device: str, dtype, rows: int, length: int, repeats: int = 5) -> dict:
    """A new shape's first step and the mean of `repeats` more."""
    ids, labels = step_batch(device, rows, length)
    started = time.perf_counter()
    train_step(model, device, dtype, ids, labels)
    first = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(repeats):
        train_step(model, device, dtype, ids, labels)
    return {"first_s": first, "steady_s": (time.perf_counter() - started) / repeats}


def profile_step(model, device: str, dtype, rows: int, length: int) -> dict:
    """`torch.profiler` over one warm step: the 15 ops with the most self time on the device (the CPU without
    one), and the device kernels launched."""
    import torch

    ids, labels = step_batch(device, rows, length)
    train_step(model, device, dtype, ids, labels)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as profile:
        train_step(model, device, dtype, ids, labels)
    key = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    events = sorted(profile.key_averages(), key=lambda e: -getattr(e, key, 0))
    kernels = [e for e in profile.events() if str(getattr(e, "device_type", "")).endswith("CUDA")]
    return {
        "top_ops": [
            {"op": e.key, "calls": e.count, "self_ms": getattr(e, key, 0) / 1e3} for e in events[:15]
        ],
        "device_events": len(kernels),
    }


def nan_loss_at(call: int):
    """`ClassificationHead.loss` whose loss is NaN at micro-batch `call` (from 1): a forced non-finite step.
    Returns the original method and the forcing one."""
    from loracls.objective import ClassificationHead

    original, calls = ClassificationHead.loss, [0]

    def forcing(self, model, batch):
        calls[0] += 1
        loss = original(self, model, batch)
        return loss * float("nan") if calls[0] == call else loss

    return original, forcing


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT") or "gpu-check"))
    parser.add_argument("--cpu", action="store_true", help="dry run: tiny model, few steps, on the CPU")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps per training run")
    args = parser.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.cpu:
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.setdefault("LORACLS_CACHE", str(out / "cache"))
    prepare_path(out)

    import torch

    from loracls.config import TrainConfig
    from loracls.environment.cpu import CPU_PRECISION_FLAGS, cpu_flags
    from loracls.environment.devices import inference_device
    from loracls.environment.diagnosis import diagnose
    from loracls.environment.doctor import collect_facts, smoke_test
    from loracls.model import load_tokenizer
    from loracls.training.baseline import baseline_on_device

    device = "cuda" if torch.cuda.is_available() else "cpu"
    flags = cpu_flags()
    result: dict = {
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "commit": git("rev-parse", "HEAD"),  # a device's .git can be stale: see src_sha256
        "src_sha256": source_digest(),
        "clean_tree": git("status", "--porcelain") == "",
        "machine": {
            "device": device,
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None,
            "cpu_flags": sorted(flags & CPU_PRECISION_FLAGS),
            "python": platform.python_version(),
            "torch": torch.__version__,
            "hip": torch.version.hip,
            "cuda": torch.version.cuda,
        },
        "mode": "cpu dry run" if args.cpu else "gpu",
        "checks": {},
    }
    checks = result["checks"]

    def check(name: str, function) -> None:
        started = time.perf_counter()
        try:
            checks[name] = {"ok": True, **function()}
        except Exception as e:  # noqa: BLE001 - every check is recorded, a failure does not stop the others
            checks[name] = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
        checks[name]["seconds"] = round(time.perf_counter() - started, 1)
        print(f"{name}: {'ok' if checks[name]['ok'] else 'FAILED ' + checks[name]['error']}", flush=True)
        (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")

    def doctor() -> dict:
        facts = collect_facts()
        report = diagnose(facts)
        smoke = smoke_test(device, facts)
        return {
            "report": report.to_json(),
            "smoke_ok": smoke.ok,
            "smoke": smoke.details,
            "why": smoke.diagnosis,
        }

    check("doctor", doctor)

    model_dir = out / "model"
    parameters = build_model(model_dir, tiny=args.cpu)
    data = out / "toy.csv"
    toy_table(2400 if not args.cpu else 240, seed=0).to_csv(data, index=False)
    steps = args.steps or (60 if not args.cpu else 4)
    batch = 32 if not args.cpu else 8
    examples = int(steps * batch / 0.8) + 1  # the training split is 80% of the data
    common = dict(
        model=str(model_dir),
        data=str(data),
        max_train_examples=min(examples, 1900 if not args.cpu else 190),
        max_eval_examples=200 if not args.cpu else 16,
        batch_size=batch,
        epochs=max(1.0, steps * batch / min(examples, 1900 if not args.cpu else 190)),
        min_steps=steps,  # --steps optimizer steps, not the default min_steps
        lr=2e-3,
        max_length=128 if not args.cpu else 48,
        target_modules="all-linear",
        lora_dropout=0.0,
        eval_every=max(steps // 2, 1),
        log_every=max(steps // 6, 1),
        save_every=10**6,
        baseline=False,
        seed=0,
    )
    result["setup"] = {"parameters": parameters, **common}

    check("train_bf16_probed", lambda: train_run("bf16", out, common, precision="bf16"))
    micro = checks["train_bf16_probed"].get("train", {}).get("micro_batch_size")
    fixed = {**common, "micro_batch_size": micro} if micro else common

    def fp32() -> dict:
        record = train_run("fp32", out, fixed, precision="fp32")
        bf16 = checks["train_bf16_probed"].get("losses")
        if bf16:
            pairs = list(zip(record["losses"], bf16, strict=False))
            record["max_abs_loss_diff_vs_bf16"] = max(abs(a - b) for a, b in pairs)
            # one loss spike can differ more than all the rest (0.07 at 1 of 60 steps on an AVX2 CPU)
            record["mean_abs_loss_diff_vs_bf16"] = sum(abs(a - b) for a, b in pairs) / len(pairs)
            record["speed_ratio_bf16_over_fp32"] = (
                checks["train_bf16_probed"]["train"]["examples_per_s"] / record["train"]["examples_per_s"]
            )
            record["steady_speed_ratio_bf16_over_fp32"] = (
                checks["train_bf16_probed"]["steady_examples_per_s"] / record["steady_examples_per_s"]
            )
        return record

    check("train_fp32", fp32)

    def fp16_nan() -> dict:
        from loracls.objective import ClassificationHead

        original, forcing = nan_loss_at(call=3)
        ClassificationHead.loss = forcing
        try:
            record = train_run("fp16-nan", out, fixed, precision="fp16", skip_nonfinite=1)
        finally:
            ClassificationHead.loss = original
        record["loss_scaler"] = device == "cuda"  # accelerate gives a CPU no scaler
        assert record["skipped_steps"], "the forced NaN step was not skipped"
        return record

    check("train_fp16_scaler_nan", fp16_nan)
    check(
        "train_gradient_checkpointing",
        lambda: train_run("checkpointing", out, fixed, precision="bf16", gradient_checkpointing=True),
    )
    # instruction tuning: the micro-batch probed through the response loss, the scorer on the GPU
    check("train_lm_bf16_probed", lambda: train_run("lm", out, common, precision="bf16", objective="lm"))

    def qlora() -> dict:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            from loracls.errors import LoraclsError

            try:
                train_run("qlora", out, fixed, quantize="4bit")
            except LoraclsError as e:
                return {"bitsandbytes": False, "refused": str(e)}
            raise AssertionError("--quantize 4bit without bitsandbytes was not refused") from None
        return {"bitsandbytes": True, **train_run("qlora", out, fixed, quantize="4bit")}

    check("qlora_4bit", qlora)

    def inference() -> dict:
        from loracls.inference.predict import Classifier

        classifier = Classifier.from_run(out / "runs" / "bf16")
        texts = list(toy_table(2000 if not args.cpu else 64, seed=9)["text"])
        classifier.predict_probs(texts[:64])  # warm-up
        sync(device)
        started = time.perf_counter()
        classifier.predict_probs(texts)
        sync(device)
        seconds = time.perf_counter() - started
        return {"texts": len(texts), "texts_per_s": len(texts) / seconds, "device": str(inference_device())}

    check("inference", inference)

    def baseline() -> dict:
        table = toy_table(400 if not args.cpu else 16, seed=7)
        before = torch.cuda.max_memory_allocated() if device == "cuda" else 0
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        metrics = baseline_on_device(
            str(model_dir),
            TrainConfig(verbalizers="negative=bad,positive=good"),
            load_tokenizer(str(model_dir)),
            table,
            ["negative", "positive"],
            None,
        )
        used = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else None
        assert device != "cuda" or used > 0.1, "the baseline allocated nothing on the GPU"
        return {
            "device": str(inference_device()),
            "gpu_peak_gb": used,
            "texts_per_s": len(table) / metrics["wall_s"],
            "accuracy": metrics["accuracy"],
            "before_gb": before / 2**30,
        }

    check("baseline_on_device", baseline)

    def mfu() -> dict:
        peak = gemm_peak_tflops(
            device, "bf16" if device == "cuda" else "fp32", 8192 if device == "cuda" else 1024
        )
        config = json.loads((model_dir / "config.json").read_text())
        embedding = config["vocab_size"] * config["hidden_size"]
        shares = {}
        for name in ("train_bf16_probed", "train_fp32", "train_gradient_checkpointing"):
            train = checks.get(name, {}).get("train")
            if train:
                # frozen base: forward 2N + backward to the inputs 2N FLOPs per token (N without embeddings)
                flops = 4 * (parameters - embedding) * train["tokens_per_s"]
                shares[name] = {"tflops": flops / 1e12, "share_of_peak": flops / 1e12 / peak}
        return {"gemm_peak_tflops": peak, "dtype": "bf16" if device == "cuda" else "fp32", "runs": shares}

    def step_shapes() -> dict:
        """One training step's forward and backward at fixed shapes: fp32, bf16 autocast over the fp32 base
        (today's way) and a bf16 base (issue 30); each new sequence length's first call, the steady mean, and
        the ops that took the most device time in a steady bf16 step. The H200 run of 2026-12-04 saw bf16
        runs' first 20 steps 4x slower than their later ones and 0.65x fp32's steady speed."""
        rows, lengths = (32, (48, 64, 96)) if not args.cpu else (4, (16, 24))
        ways: dict = {}
        for way in ("fp32", "bf16_autocast", "bf16_base"):
            model = lora_model(model_dir, device, bf16_base=way == "bf16_base")
            dtype = None if way == "fp32" else torch.bfloat16
            ways[way] = {n: time_step(model, device, dtype, rows, n) for n in lengths}
            if way == "bf16_autocast":
                ways["bf16_autocast_profile"] = profile_step(model, device, dtype, rows, lengths[-1])
        steady = {
            w: sum(t["steady_s"] for t in ways[w].values()) for w in ("fp32", "bf16_autocast", "bf16_base")
        }
        return {
            "rows": rows,
            "ways": ways,
            "steady_speed_over_fp32": {w: steady["fp32"] / steady[w] for w in steady},
        }

    check("step_shapes", step_shapes)
    check("mfu", mfu)
    result["all_ok"] = all(c["ok"] for c in checks.values())
    (out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"written: {out / 'gpu_check.json'} (all ok: {result['all_ok']})")
    return 0 if result["all_ok"] else 1


def source_digest() -> str:
    """SHA-256 of src/'s Python files (paths and contents): the code that ran, even where .git is stale."""
    digest = hashlib.sha256()
    for path in sorted((ROOT / "src").rglob("*.py")):
        digest.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def git(*args: str) -> str | None:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    sys.exit(main())
