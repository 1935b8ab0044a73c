"""`train()`: the run stage by stage (environment → prompt and baseline → model → LoRA → `fit()` → test
the best → metrics), writing the run folder as it goes; `resume()` continues an unfinished one."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from accelerate import Accelerator, PartialState
from accelerate.state import AcceleratorState
from accelerate.utils import DistributedType, broadcast_object_list, parse_flag_from_env, set_seed
from datasets import Dataset
from peft import PeftModel, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import DataCollatorWithPadding, PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.console import confusion_table, console, interrupted_at, per_class_table
from loracls.data.labels import labels_line
from loracls.data.prompts import parse_verbalizers, read_descriptions
from loracls.data.splits import Splits, load_splits
from loracls.data.tokenization import tokenize, truncated_share
from loracls.environment.cpu import emulated_bf16_warning
from loracls.environment.devices import OFFLOAD_COST, mixed_precision, offload_in_use
from loracls.environment.diagnosis import Facts, diagnose
from loracls.environment.doctor import check_before_training, check_quantization, collect_facts
from loracls.environment.micro_batch import micro_batch_size
from loracls.errors import Interrupted, LoraclsError
from loracls.files import disk_full, no_space, written_file
from loracls.lora import (
    TargetPlan,
    apply_lora,
    frozen_linears_in,
    keep_frozen_base,
    resolve_capacity,
    targets_line,
    targets_table,
)
from loracls.model import describe, load_tokenizer, resolve_model
from loracls.objective import Objective, input_prompter, objective_kind
from loracls.training import checkpoints
from loracls.training.baseline import (
    baseline_summary,
    prompt_and_baseline,
)
from loracls.training.evaluate import describe_learning, learning_summary, score_test_split
from loracls.training.fit import FitResult, accumulation, fit
from loracls.training.report import build_report, read_jsonl
from loracls.training.runs import RunFolder, default_out, environment, write_jsonl


def cpu_only() -> bool:
    """No GPU: accelerate then runs several processes on the CPU (gloo) instead of expecting one per GPU."""
    return not torch.cuda.is_available() and not torch.backends.mps.is_available()


def speed_options(model: PeftModel, cfg: TrainConfig) -> None:
    """Gradient checkpointing and `torch.compile` (of each decoder layer, in place), when asked for."""
    if cfg.gradient_checkpointing:
        # non-reentrant: works with frozen inputs (no enable_input_require_grads) and with LoRA's dropout
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.compile:
        # in place, layer by layer: the parameter names (and so the saved adapter) stay as they are
        layers = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList) and len(m) > 1]
        for layer in max(layers, key=lambda m: sum(p.numel() for p in m.parameters())):
            layer.compile(dynamic=True)


def store_frozen_base(model: PeftModel, cfg: TrainConfig, accelerator: Accelerator) -> None:
    """Resolve `frozen_base` and keep the decoder's frozen linears so (`lora.keep_frozen_base`): in the dtype
    autocast computes here (accelerate does not autocast fp16 on a CPU); not under FSDP, which shards a
    layer's weights as one dtype, nor QLoRA's 4-bit layers."""
    with accelerator.autocast():
        kind = accelerator.device.type
        computes = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
    if accelerator.is_fsdp2 or cfg.quantize:
        computes = None
    cfg.frozen_base, cast = keep_frozen_base(model, cfg.frozen_base, computes)
    if cast:
        console.print(
            f"[dim]frozen base: {cast} linear weights stored in {cfg.frozen_base}, "
            "as autocast computes them[/]"
        )


def choose_micro_batch(
    model: PeftModel,
    train_set: Dataset,
    tokenizer: PreTrainedTokenizerBase,
    objective: Objective,
    cfg: TrainConfig,
    accelerator: Accelerator,
) -> None:
    """Set `cfg.micro_batch_size` (probing the device with the objective's loss when unset) and the
    accumulation that reaches `batch_size`; the run's `config.yaml` records the value, so a resume uses the
    same one."""
    lengths = [len(x) for x in train_set["input_ids"]]
    example = DataCollatorWithPadding(tokenizer)([train_set[int(np.argmax(lengths))]])
    key = (cfg.model, max(lengths), accelerator.mixed_precision, cfg.lora_r, cfg.target_modules)
    key += (cfg.gradient_checkpointing, cfg.quantize, cfg.attention, objective.classes(model), cfg.objective)
    size, how = micro_batch_size(
        cfg.micro_batch_size, cfg.batch_size, accelerator, model, dict(example), key, objective.loss
    )
    if how != "set":
        console.print(f"micro-batch {size} ({how}; set --micro-batch-size to choose)")
        cfg.micro_batch_size = size
    accelerator.gradient_accumulation_steps = accumulation(cfg)


def check_requirements(cfg: TrainConfig) -> None:
    """What the config asks of the machine, checked before a run folder exists."""
    if cfg.track is not None and importlib.util.find_spec(cfg.track) is None:
        raise LoraclsError(f"--track {cfg.track} needs the package: pip install {cfg.track}")
    if cfg.quantize and parse_flag_from_env("ACCELERATE_USE_FSDP"):  # how accelerate launch asks for FSDP
        raise LoraclsError(
            f"--quantize {cfg.quantize} is not supported under FSDP (loracls shards full-precision weights "
            "only): use DDP, where each GPU holds the 4-bit base, or FSDP without --quantize."
        )
    if cfg.quantize and cpu_only():
        check_quantization(torch.device("cpu"), None)


def start_tracking(accelerator: Accelerator, cfg: TrainConfig, run: RunFolder) -> None:
    """With `track`, start accelerate's tracker (TensorBoard or MLflow) with the run's config."""
    if cfg.track is None:
        return
    config = {k: v if isinstance(v, int | float | str | bool) else str(v) for k, v in cfg.to_dict().items()}
    accelerator.init_trackers(
        "loracls" if cfg.track == "mlflow" else run.path.name,
        config=config,
        init_kwargs={"mlflow": {"run_name": run.path.name}},
    )


def train(cfg: TrainConfig, overwrite: bool = False) -> tuple[RunFolder, dict]:
    """The whole job; returns the run folder and the metrics written to `RUN/metrics.json`.

    `overwrite` starts again in a folder that holds an unfinished run no process is writing. Under
    `accelerate launch` or `torchrun`, every process runs this; only the main one writes.
    """
    check_requirements(cfg)
    processes = PartialState(cpu=cpu_only())
    console.quiet = not processes.is_main_process
    with stop_on_signals("stopped while loading the data; no run was started"):
        splits = load_splits(cfg)
        for note in splits.notes:
            console.print(f"[dim]data: {note}[/]")
        console.print(
            f"data: {len(splits.train)} train / {len(splits.val)} val / {len(splits.test)} test, "
            f"{labels_line(splits.labels)}"
        )
        parse_verbalizers(cfg.verbalizers, splits.labels)  # refused before a run folder exists
        cfg.label_descriptions = read_descriptions(cfg.label_descriptions, splits.labels)  # config.yaml: them
        if chosen := resolve_capacity(cfg, len(splits.labels)):  # config.yaml: what was chosen
            console.print(chosen)
        out = [cfg.out or default_out(cfg.data)]
        if processes.num_processes > 1:
            broadcast_object_list(out)  # one folder, even when the processes' clocks read different seconds
        run = RunFolder.create(out[0], cfg.data, processes.is_main_process, overwrite)
        processes.wait_for_everyone()  # every process has checked the folder before the main one writes
        run.open()
        cfg.out, cfg.label_type = str(run.path), splits.label_type
        return run_with_status(run, cfg, splits, resume=None)


def write_inputs(run: RunFolder, cfg: TrainConfig, splits: Splits) -> None:
    """What a new run records first: its labels and data splits (its config once resolved: `run_stages`)."""
    run.stage = "writing the run's data splits"
    run.write_json("labels.json", {"id2label": dict(enumerate(splits.labels)), "label2id": splits.label2id})
    if run.main:
        for name in ("train", "val", "test"):
            write_jsonl(run.file(f"data/{name}.jsonl"), getattr(splits, name))
    run.write_json("data/notes.json", splits.notes)


def resume(run_dir: str | Path) -> tuple[RunFolder, dict]:
    """Continue an unfinished run from its last checkpoint, with its own config and data splits."""
    processes = PartialState(cpu=cpu_only())
    console.quiet = not processes.is_main_process
    run = RunFolder(Path(run_dir), processes.is_main_process)
    state = run.status()
    if state == "finished":
        raise LoraclsError(f"{run.path} already finished; nothing to resume")
    with stop_on_signals(f"stopped before resuming; {run.path} is as it was"):
        run.lock()  # before anything is read or truncated: a live run is refused
        try:
            checkpoint = checkpoints.resumable(run.path, processes.num_processes, run.main)
            if checkpoint is None:
                raise LoraclsError(
                    f"{run.path} (status: {state}) has no complete checkpoint to resume from; start it "
                    "again: the same `loracls train` command with --overwrite"
                )
            cfg = run.read_config()
            check_requirements(cfg)
            checkpoints.check_resume(checkpoint, cfg, run.path, processes.num_processes)
            splits = run.read_splits()
            checkpoints.check_log(run)
        except BaseException:
            run.unlock()
            raise
        step = json.loads((checkpoint / checkpoints.STATE_FILE).read_text(encoding="utf-8"))["step"]
        run.truncate_log(step)  # what the stopped process logged after its last checkpoint is done again
        console.print(f"Resuming {run.path} from {checkpoint.name} (status was: {state})")
        return run_with_status(run, cfg, splits, resume=checkpoint)


class StopRequested(KeyboardInterrupt):
    """SIGINT or SIGTERM outside `fit()`'s loop (whose own handler checkpoints first)."""


@contextlib.contextmanager
def stop_on_signals(before: str) -> Iterator[None]:
    """For the run's lifetime, SIGINT and SIGTERM raise `StopRequested` wherever the run is, so that
    `run_with_status()` records it; one before `run_with_status()` ends with the message `before`."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handle(number: int, frame) -> None:
        raise StopRequested(signal.Signals(number).name)

    previous = {number: signal.signal(number, handle) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    except StopRequested as e:
        raise Interrupted(f"{e}: {before}") from None
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)


def run_with_status(
    run: RunFolder, cfg: TrainConfig, splits: Splits, resume: Path | None
) -> tuple[RunFolder, dict]:
    """`run_stages()` with `RUN/status.json` saying running, then finished, interrupted or failed, and the
    run's lock released at the end. A signal, a full disk or an error anywhere ends with a message that
    says what the run was doing and how to continue."""
    try:
        run.set_status("running", resumed_from=str(resume) if resume else None)
        if resume is None:
            write_inputs(run, cfg, splits)
        run.recover()
        metrics = run_stages(run, cfg, splits, resume)
        run.stage = "writing the report"
        run.set_status("finished")
        if run.main:  # after the status: the report says whether the run finished
            console.print(f"report: {build_report(run.path)}", soft_wrap=True)
    except (Interrupted, KeyboardInterrupt) as e:
        message = str(e) if isinstance(e, Interrupted) else f"{str(e) or 'KeyboardInterrupt'}: stopped while "
        if not isinstance(e, Interrupted):
            at = interrupted_at(e)  # where in the stage: "prompt search: candidate 7 of 20, ..."
            message += run.stage + (f" ({at})" if at else "") + f"; {next_step(run)}"
        raise Interrupted(message + record_end(run, "interrupted", message)) from None
    except BaseException as e:
        if (no_space(e) or disk_full(run.path)) and not isinstance(e, LoraclsError):
            where = written_file(e) or f"a file in {run.path}"
            message = f"No space left on device writing {where} (while {run.stage}): free space, then "
            message += next_step(run)
            raise LoraclsError(message + record_end(run, "failed", message)) from None
        note = record_end(run, "failed", f"{type(e).__name__}: {e}")
        if note and isinstance(e, LoraclsError):
            e.args = (f"{e}{note}",)
        raise
    finally:
        run.unlock()
    return run, metrics


def next_step(run: RunFolder) -> str:
    """How to continue a stopped run: resume from its checkpoint, or start again without one."""
    if checkpoints.latest(run.path) is not None:
        return f"`loracls train --resume {run.path}`"
    return "start it again (no checkpoint yet): the same `loracls train` command with --overwrite"


def record_end(run: RunFolder, state: str, error: str) -> str:
    """Write the run's end into status.json; returns what to add to the message when even that fails."""
    try:
        run.set_status(state, error=error)
    except OSError as e:
        status = run.file("status.json")
        return f" (and {status} could not be written either: {e.strerror}; it says what it said before)"
    return ""


def run_stages(run: RunFolder, cfg: TrainConfig, splits: Splits, resume: Path | None = None) -> dict:
    """The stages of a run, in order, written into an open run folder; returns `RUN/metrics.json`."""
    run.stage = "checking the environment"
    accelerator = make_accelerator(cfg, run)
    facts = collect_facts()
    record_environment(run, accelerator, facts, resume)
    if cfg.smoke_test and accelerator.device.type == "cuda":
        check_before_training(str(accelerator.device), facts)
    if cfg.quantize:
        check_quantization(accelerator.device, facts)
    run.stage = "loading the tokenizer"
    model_path = resolve_model(cfg.model)
    tokenizer = load_tokenizer(model_path, cfg.trust_remote_code)
    run.stage = "choosing the prompt and scoring the baseline"
    baseline, head_rows = prompt_and_baseline(model_path, tokenizer, splits, cfg, run, accelerator, resume)
    set_seed(cfg.seed)  # here, so the head, LoRA and data order do not depend on whether the baseline ran
    run.stage = "loading the model"
    kind = objective_kind(cfg.objective)
    model = kind.load(
        model_path,
        splits.labels,
        trust_remote_code=cfg.trust_remote_code,
        head_init=cfg.head_init,
        allow_pickle=cfg.allow_pickle,
        multi_label=cfg.multi_label,
        quantize=cfg.quantize,
        attention=cfg.attention,
        mixed_precision=accelerator.mixed_precision,
        head_rows=head_rows,
    )
    model.config.pad_token_id = tokenizer.pad_token_id
    console.print(describe(model))
    run.stage = "tokenizing the data"
    prompter = input_prompter(tokenizer, cfg, splits.labels)
    train_set = tokenize(splits.train, tokenizer, cfg.max_length, splits.label2id, prompter, "tokenize train")
    val_set, test_set = (  # a text over max_length: as cfg.long_texts reads it (training cuts it)
        tokenize(table, tokenizer, cfg.max_length, splits.label2id, prompter, f"tokenize {name}",
                 cfg.long_texts, cfg.window_stride)
        for name, table in (("validation", splits.val), ("test", splits.test))
    )  # fmt: skip
    train_set = kind.training_set(train_set, splits.train, prompter, splits.label2id)
    objective = kind.for_training(cfg, train_set, prompter, splits.labels, accelerator)
    share = truncated_share(splits.train, tokenizer, cfg.max_length)
    if share > 0.05:
        console.print(
            f"[yellow]{share:.0%} of training texts are truncated at max_length={cfg.max_length}[/]"
        )
    run.stage = "applying LoRA and choosing the micro-batch"
    model, plan = apply_lora(model, cfg)
    run.write_json("targets.json", plan.to_json())
    console.print(targets_table(plan, f"LoRA targets: {cfg.target_modules}"))
    console.print(targets_line(plan))
    store_frozen_base(model, cfg, accelerator)
    speed_options(model, cfg)
    choose_micro_batch(model, train_set, tokenizer, objective, cfg, accelerator)
    if resume is None:  # resolved now, once: the prompt, the head's start, the chat template, the micro-batch
        run.write_config(cfg)

    run.stage = "training"
    result = fit(model, tokenizer, train_set, val_set, splits, cfg, run, accelerator, objective, resume)

    run.stage = "testing the best checkpoint"
    best = best_model(model, result, cfg, run, accelerator)
    test, calibration = score_test_split(
        best, val_set, test_set, tokenizer, splits, cfg, run, accelerator, objective
    )
    log = read_jsonl(run.file("train_log.jsonl")) if run.main else []
    run.stage = "writing the metrics"
    metrics = {
        "test": test,
        "baseline": baseline_summary(baseline),
        "best_val": {"step": result.best_step, **result.best_val},
        "learning": learning_summary(log, cfg.metric, result.steps, test),
        "calibration": calibration,
        **run_figures(result, cfg, splits, share, plan, accelerator),
        "stages": stage_seconds(run, resume),
    }
    run.write_json("metrics.json", metrics)
    accelerator.log({"test_accuracy": test["accuracy"], "test_macro_f1": test["macro_f1"]}, step=result.steps)
    del model, best  # under DDP/FSDP they hold the process group, which end_processes() destroys
    end_processes(accelerator)
    return metrics


def stage_seconds(run: RunFolder, resume: Path | None) -> dict:
    """Seconds per stage of this process's run (`RunFolder.stage_seconds`; a resumed run's count from the
    resume), and each one's share of their total: where a run's time went."""
    seconds = dict(run.stage_seconds)
    total = sum(seconds.values())
    return {
        "seconds": seconds,
        "share": {name: round(t / total, 3) for name, t in seconds.items()} if total else {},
        "resumed": resume is not None,
    }


def run_figures(
    result: FitResult,
    cfg: TrainConfig,
    splits: Splits,
    share: float,
    plan: TargetPlan,
    accelerator: Accelerator,
) -> dict:
    """What metrics.json records of how the run trained: throughput and batch, data sizes and notes, the
    trainable parameters."""
    return {
        "train": {
            **result.throughput,
            "micro_batch_size": cfg.micro_batch_size,
            "accumulation": accumulation(cfg),
            "mixed_precision": accelerator.mixed_precision,
        },
        "data": {
            **{name: len(getattr(splits, name)) for name in ("train", "val", "test")},
            "notes": splits.notes,
            "truncated_share": share,
        },
        "trainable_parameters": {
            "lora": plan.lora_parameters,
            "head": plan.head_parameters,
            "trainable": plan.trainable,
            "base": plan.base_parameters,
            "share": plan.share,
        },
    }


def end_processes(accelerator: Accelerator) -> None:
    """Stop the trackers and destroy the process group once every process is done, with the wrapped model
    released first, so nothing of the group is left for the interpreter's exit to tear down: gloo's threads
    racing interpreter finalisation abort a process now and then (pytorch/pytorch#190489)."""
    accelerator.wait_for_everyone()
    accelerator.free_memory()
    accelerator.end_training()


def make_accelerator(cfg: TrainConfig, run: RunFolder) -> Accelerator:
    """The run's `Accelerator` (device, precision, processes, trackers); refuses FSDP version 1."""
    # an earlier run in this process (a sweep, a test) may have used another precision; the processes stay
    AcceleratorState._reset_state()
    accelerator = Accelerator(
        cpu=cpu_only(),
        mixed_precision=mixed_precision(cfg.precision),
        step_scheduler_with_optimizer=False,  # fit() steps it once per optimizer step, whatever the processes
        log_with=cfg.track,
        project_dir=str(run.file("tracking")),
    )
    if accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2:
        raise LoraclsError(
            "FSDP version 1 is not supported: set `fsdp_version: 2` under `fsdp_config` in the accelerate "
            "config (see configs/accelerate/fsdp-1node.yaml) or FSDP_VERSION=2."
        )
    slow = emulated_bf16_warning(cfg.precision, accelerator.device.type)
    if slow:
        console.print(f"[yellow]{slow}[/]", soft_wrap=True)
    start_tracking(accelerator, cfg, run)
    return accelerator


def record_environment(run: RunFolder, accelerator: Accelerator, facts: Facts, resume: Path | None) -> None:
    """`RUN/env.json`: versions, device, precision, processes, offload and the doctor's verdicts. A resume
    keeps the first environment and adds where and on what it continued."""
    offload = offload_in_use(accelerator)
    if offload:
        console.print(f"[yellow]{offload}: {OFFLOAD_COST}[/]")
    env = {
        **environment(accelerator.device),
        "mixed_precision": accelerator.mixed_precision,
        "distributed": {
            "type": accelerator.distributed_type.value,
            "processes": accelerator.num_processes,
            "fsdp_version": accelerator.state.fsdp_plugin.fsdp_version if accelerator.is_fsdp2 else None,
        },
        "offload": offload,
        "system_rocm": facts.system_rocm,
        "driver": facts.driver,
        "doctor": diagnose(facts).to_json(),
    }
    run.record_environment(env, resume)


def best_model(
    model: torch.nn.Module, result: FitResult, cfg: TrainConfig, run: RunFolder, accelerator: Accelerator
) -> torch.nn.Module:
    """The best step's model, as the test scores it: merged into the base; under FSDP sharded with LoRA
    unmerged; under QLoRA unmerged on the 4-bit base, as validation scored it (merging would re-quantise
    LoRA's update)."""
    if accelerator.is_fsdp2:
        accelerator.load_state(str(checkpoints.step_folder(run.path, result.best_step)))
        return model
    model = accelerator.unwrap_model(model)
    set_peft_model_state_dict(model, load_peft_weights(str(run.best)))
    if cfg.quantize:
        return model
    # a 16-bit frozen base back in fp32 (exactly): LoRA merges in fp32, as `merge_adapter` merges it into
    # the base rounded alike
    frozen_linears_in(model, torch.float32)
    return model.merge_and_unload()


def print_outcome(run: RunFolder, metrics: dict) -> None:
    """What `loracls train` prints at the end: the test figures against the prompt baseline, how the run
    learned (`describe_learning`), the per-class table, the confusion matrix and the run folder."""
    test = metrics["test"]
    console.print(
        f"\n[bold]test accuracy {test['accuracy']:.4f}  macro-F1 {test['macro_f1']:.4f}[/]  "
        f"(best validation step {metrics['best_val']['step']}, "
        f"{metrics['train']['examples_per_s']:.1f} train examples/s)"
    )
    if metrics["baseline"]:
        base = metrics["baseline"]
        console.print(
            f"prompt baseline ({base['headline']}, {base['shots']}-shot) accuracy {base['accuracy']:.4f}, "
            f"macro-F1 {base['macro_f1']:.4f}; fine-tuned: {test['accuracy'] - base['accuracy']:+.4f} "
            f"accuracy, {test['macro_f1'] - base['macro_f1']:+.4f} macro-F1"
        )
    for line in describe_learning(metrics["learning"]):
        console.print(line, soft_wrap=True)
    console.print(per_class_table(test))
    if "confusion_matrix" in test:  # single-label; a multi-label run has one 2x2 matrix per label
        console.print(confusion_table(test))
    console.print(f"run folder: {run.path}", soft_wrap=True)
