"""Training checkpoints: everything needed to continue a run exactly where it stopped.

RUN/checkpoints/step_NNNNNN/
    adapter/                   LoRA matrices and the trained head (PEFT, safetensors)
    optimizer.bin, scheduler.bin, random_states_0.pkl
                               `Accelerator.save_state`: AdamW moments, schedule, RNG states
    trainer_state.json         `TrainerState`: step, position in the data, best so far, counters
    fingerprint.json           what the checkpoint was trained with: the resolved config (less what does
                               not change training), a hash of each split file, the process count
    pytorch_model_fsdp_0/, optimizer_0/
                               under FSDP instead of optimizer.bin: the sharded model and optimizer state
                               (accelerate saves the whole sharded model, frozen base weights included)

A checkpoint is written into `step_NNNNNN.tmp`, fsynced, and renamed when whole, so a folder without `.tmp`
is complete and a failed write (disk full, a kill) leaves the previous checkpoints as they were. A resume
still checks the one it picks (`resumable`): a damaged checkpoint (a disk error, a copy cut short) is moved
aside as `step_NNNNNN.damaged` and the previous intact one is used; a resume under other settings, data or
processes than the checkpoint was trained with is refused (`check_resume`), since it would not continue the
same run.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import shutil
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import load as accelerate_load
from peft import PeftModel, set_peft_model_state_dict
from peft.utils import load_peft_weights
from safetensors.torch import load_file
from transformers import PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.console import console
from loracls.errors import LoraclsError
from loracls.files import atomic_folder, disk_full, no_space, write_text, written_file
from loracls.training.runs import RunFolder
from loracls.training.trainer_state import TrainerState, gather_window

FOLDER = "checkpoints"
STATE_FILE = "trainer_state.json"
FINGERPRINT_FILE = "fingerprint.json"
ADAPTER = "adapter"
SPLIT_FILES = ("data/train.jsonl", "data/val.jsonl", "data/test.jsonl")
NOT_TRAINING = ("out", "save_every", "keep_checkpoints", "track", "smoke_test")
"""Config fields a resume may change: where and how often checkpoints are kept, tracking, the smoke test."""


def save_adapter(accelerator: Accelerator, model: torch.nn.Module, folder: Path) -> None:
    """Write the adapter (LoRA + head) of `model` to `folder` as PEFT does.

    Every process calls this: under FSDP the trainable parameters are shards (DTensors), gathered here into
    whole tensors (a collective; the frozen base stays sharded); the main process writes.
    """
    model = accelerator.unwrap_model(model)
    state = None
    if accelerator.is_fsdp2:
        from torch.distributed.tensor import DTensor  # only where torch has distributed support

        trainable = {name for name, p in model.named_parameters() if p.requires_grad}
        state = {
            name: t.full_tensor() if isinstance(t, DTensor) else t
            for name, t in model.state_dict().items()
            if name in trainable
        }
    if accelerator.is_main_process:
        model.save_pretrained(folder, state_dict=state)


def register_adapter_hooks(accelerator: Accelerator, model: PeftModel) -> None:
    """Make `save_state`/`load_state` store the PEFT adapter (LoRA + head), not the frozen base weights.

    Under FSDP, accelerate saves and loads the sharded model itself (no `models` reach the load hook); the
    adapter folder is written beside it all the same, for RUN/best and for reading a checkpoint by hand.
    """

    def save(models, weights, output_dir) -> None:
        save_adapter(accelerator, model, Path(output_dir) / ADAPTER)
        weights.clear()

    def load(models, input_dir) -> None:
        if models:
            adapter = load_peft_weights(str(Path(input_dir) / ADAPTER))
            set_peft_model_state_dict(accelerator.unwrap_model(models[0]), adapter)
        models.clear()

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)


def step_folder(run_path: Path, step: int) -> Path:
    return run_path / FOLDER / f"step_{step:06d}"


def complete(run_path: Path) -> list[Path]:
    """Whole checkpoints of a run, oldest first."""
    folder = run_path / FOLDER
    if not folder.is_dir():
        return []
    found = [
        p for p in folder.iterdir() if re.fullmatch(r"step_\d{6}", p.name) and (p / STATE_FILE).is_file()
    ]
    return sorted(found)


def latest(run_path: Path) -> Path | None:
    found = complete(run_path)
    return found[-1] if found else None


class CheckpointWriteError(LoraclsError, OSError):
    """A checkpoint could not be written (its `.tmp` is removed); `errno` is ENOSPC when the disk filled up
    and `filename` the file being written."""

    def __init__(self, message: str, code: int | None, filename: str | None) -> None:
        OSError.__init__(self, code, message, filename)
        self.message = message

    def __str__(self) -> str:
        return self.message


def save(
    accelerator: Accelerator, state: TrainerState, run_path: Path, keep: int, fingerprint: dict | None = None
) -> Path:
    """Write a checkpoint of `state.step` atomically (with `fingerprint`, what it was trained with), then
    keep only the last `keep` and the best.

    Every process calls this (each saves its own RNG state); the main one writes the rest and renames. A
    failed write raises `CheckpointWriteError` and leaves no `.tmp`.
    """
    main = accelerator.is_main_process
    gather_window(accelerator, state)
    final = step_folder(run_path, state.step)
    tmp = final.with_name(final.name + ".tmp")
    if main:
        shutil.rmtree(tmp, ignore_errors=True)
    accelerator.wait_for_everyone()
    try:
        accelerator.save_state(str(tmp))
        accelerator.wait_for_everyone()
        if main:
            (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=2) + "\n", encoding="utf-8")
            if fingerprint is not None:
                write_text(tmp / FINGERPRINT_FILE, json.dumps(fingerprint, indent=2) + "\n")
            sync_folder(tmp)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
            sync_folder(final.parent, files=False)
        accelerator.wait_for_everyone()
    except Exception as e:  # torch.save says RuntimeError on a full disk, safetensors its own error
        raise write_error(e, state.step, tmp, final, run_path) from None
    if main:
        prune(run_path, keep, state.best_step)
    return final


def write_error(error: Exception, step: int, tmp: Path, final: Path, run_path: Path) -> CheckpointWriteError:
    """The error of a failed checkpoint write, with its `.tmp` removed: ENOSPC when the disk is full."""
    code = next((e.errno for e in causes(error) if isinstance(e, OSError) and e.errno), None)
    written = sorted((f for f in tmp.rglob("*") if f.is_file()), key=lambda f: f.stat().st_mtime_ns)
    filename = written_file(error) or (str(written[-1]) if written else str(tmp))
    if no_space(error) or (code is None and disk_full(tmp)):
        code = errno.ENOSPC
    shutil.rmtree(tmp, ignore_errors=True)
    reason = f"No space left on device ({filename})" if code == errno.ENOSPC else f"{error} ({filename})"
    previous = latest(run_path)
    return CheckpointWriteError(
        f"Could not write the checkpoint of step {step} to {final}: {reason}. "
        f"The previous checkpoint is intact: {previous or 'none yet'}. "
        + ("Free space, then " if code == errno.ENOSPC else "Then ")
        + f"`loracls train --resume {run_path}`.",
        code,
        filename,
    )


def causes(error: BaseException) -> list[BaseException]:
    """`error` and the exceptions it was raised from or during."""
    found = []
    while error is not None and error not in found:
        found.append(error)
        error = error.__cause__ or error.__context__
    return found


def sync_folder(folder: Path, files: bool = True) -> None:
    """fsync every file under `folder` (with `files`) and the folders themselves, so that a rename after it
    does not put in place a checkpoint whose contents are still only in the page cache."""
    folders = [folder]
    if files:
        for path in folder.rglob("*"):
            if path.is_dir():
                folders.append(path)
                continue
            with path.open("rb") as f:
                os.fsync(f.fileno())
    for path in folders:
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def prune(run_path: Path, keep: int, best_step: int) -> None:
    """Keep the last `keep` checkpoints and the best."""
    for old in complete(run_path)[:-keep]:
        if old.name != step_folder(run_path, best_step).name:
            shutil.rmtree(old, ignore_errors=True)


def load(accelerator: Accelerator, folder: Path) -> TrainerState:
    """Restore adapter, optimizer, scheduler and RNG from `folder`; return its `TrainerState`.

    accelerate only logs a missing or unreadable RNG state, and a resume without it is not the same run: it is
    checked first. The log window in progress is the main process's (`gather_window`)."""
    rng = f"random_states_{accelerator.process_index}.pkl"
    problem = file_problem(folder / rng, accelerate_load)
    if problem:
        raise LoraclsError(f"Cannot resume from {folder}: {problem}. Resume from an intact checkpoint.")
    try:
        accelerator.load_state(str(folder))
    except Exception as e:
        raise LoraclsError(
            f"Cannot resume from {folder}: accelerate could not load it ({type(e).__name__}: {e})"
        ) from None
    state = TrainerState(**json.loads((folder / STATE_FILE).read_text(encoding="utf-8")))
    if not accelerator.is_main_process:
        state.set_window(0.0, 0, 0, 0)
    return state


def save_best(
    accelerator: Accelerator, model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase, run: RunFolder
) -> None:
    """Adapter, head and tokenizer into RUN/best, replaced in one rename; a failed write keeps the old one.

    Every process calls this (under FSDP the adapter is gathered from all); the main one writes.
    """
    if not run.main:
        save_adapter(accelerator, model, run.best)  # joins the gather; only the main process writes
        return
    try:
        with atomic_folder(run.best) as tmp:
            save_adapter(accelerator, model, tmp)
            tokenizer.save_pretrained(tmp)
    except OSError as e:
        raise LoraclsError(
            f"Could not write the new best checkpoint to {run.best}: {e}. The previous best is intact; free "
            f"space, then `loracls train --resume {run.path}`."
        ) from None


def restore_best(run: RunFolder, tokenizer: PreTrainedTokenizerBase, state: TrainerState) -> None:
    """On resume, RUN/best may hold a later step than the checkpoint's best: put that best back."""
    if state.best_val is None:
        shutil.rmtree(run.best, ignore_errors=True)
        return
    with atomic_folder(run.best) as tmp:
        shutil.copytree(step_folder(run.path, state.best_step) / ADAPTER, tmp, dirs_exist_ok=True)
        tokenizer.save_pretrained(tmp)


def fingerprint(cfg: TrainConfig, run_path: Path, processes: int) -> dict:
    """What a checkpoint is trained with and a resume must match: the resolved config (less
    `NOT_TRAINING`), the SHA-256 of each split file in RUN/data, and the number of processes."""
    config = json.loads(json.dumps(cfg.to_dict(), default=str))
    return {
        "config": {k: v for k, v in config.items() if k not in NOT_TRAINING},
        "data": {name: file_sha256(run_path / name) for name in SPLIT_FILES},
        "processes": processes,
    }


def file_sha256(path: Path) -> str | None:
    if not path.is_file():
        return None
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(2**20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_resume(checkpoint: Path, cfg: TrainConfig, run_path: Path, processes: int) -> None:
    """Refuse to resume from `checkpoint` with a config, split files or process count other than it was
    trained with: the continued run would be neither the old one nor a new one (an edited batch size mixes
    two, an edited `lr` is ignored by the restored scheduler, a cut split trains on fewer rows)."""
    saved = read_json(checkpoint / FINGERPRINT_FILE)
    if saved is None:  # written before checkpoints kept a fingerprint
        console.print(f"[yellow]{checkpoint.name} records no fingerprint: its settings are not checked[/]")
        return
    now = fingerprint(cfg, run_path, processes)
    changes = [
        f"{key}: {saved['config'].get(key)!r} in the checkpoint, {now['config'].get(key)!r} in config.yaml"
        for key in sorted(set(saved["config"]) | set(now["config"]))
        if saved["config"].get(key) != now["config"].get(key)
    ]
    changes += [
        f"{name} is not the file {checkpoint.name} was trained on (its content changed)"
        for name in SPLIT_FILES
        if saved["data"].get(name) != now["data"][name]
    ]
    if saved["processes"] != processes:
        changes.append(
            f"processes: {saved['processes']} trained {checkpoint.name}, {processes} resumes it (each "
            "optimizer step's batch would change); launch the resume as the run was launched"
        )
    if changes:
        raise LoraclsError(
            f"Cannot resume {run_path}: {checkpoint.name} was trained with other settings; "
            + "; ".join(changes)
            + ". Put them back as they were, or start a new run with the new ones."
        )


def read_json(path: Path) -> dict | None:
    """A checkpoint's JSON file, None when it is missing (validated before a resume picks the checkpoint)."""
    if not path.is_file():
        return None
    return json.loads(path.read_text(encoding="utf-8"))


def file_problem(path: Path, read, name: str | None = None) -> str | None:
    """Why `read(path)` fails (missing, empty, unreadable), or None; `name`: the file as messages say it."""
    name = name or path.name
    if not path.is_file():
        return f"{name} is missing"
    if path.stat().st_size == 0:
        return f"{name} is empty"
    try:
        read(path)
    except Exception as e:
        first = (str(e).strip() or "?").splitlines()[0]
        return f"{name} is unreadable ({type(e).__name__}: {first})"
    return None


def read_state(path: Path) -> TrainerState:
    return TrainerState(**json.loads(path.read_text(encoding="utf-8")))


def damage(folder: Path, processes: int) -> list[str]:
    """What is wrong with checkpoint `folder`: each file a resume reads, missing or unreadable (one RNG state
    per process it was trained with; `processes` when it does not say). Reads them all: the adapter and
    optimizer are LoRA-sized."""
    if (folder / FINGERPRINT_FILE).exists() and (
        problem := file_problem(folder / FINGERPRINT_FILE, read_json)
    ):
        return [problem]
    processes = (read_json(folder / FINGERPRINT_FILE) or {}).get("processes", processes)
    sharded = (folder / "optimizer_0").is_dir()  # FSDP: the model and optimizer as folders of shards
    readers = {STATE_FILE: read_state, f"{ADAPTER}/adapter_config.json": read_json}
    readers[f"{ADAPTER}/adapter_model.safetensors"] = load_file
    if not sharded:
        readers["optimizer.bin"] = lambda p: accelerate_load(p, map_location="cpu")
    readers["scheduler.bin"] = accelerate_load
    readers |= dict.fromkeys([f"random_states_{i}.pkl" for i in range(processes)], accelerate_load)
    problems = [p for name, read in readers.items() if (p := file_problem(folder / name, read, name))]
    return problems + [
        f"{name}/ is missing or empty"
        for name in (("optimizer_0", "pytorch_model_fsdp_0") if sharded else ())
        if not any((folder / name).iterdir())
    ]


def resumable(run_path: Path, processes: int, main: bool) -> Path | None:
    """The latest intact checkpoint of a run (None when it has none at all). A damaged later one is moved
    aside to `step_NNNNNN.damaged` (by the main process), saying what is wrong with it; when none is intact
    the error names the damaged files."""
    found = complete(run_path)
    damaged = []
    for folder in reversed(found):
        problems = damage(folder, processes)
        if not problems:
            for bad, why in damaged:
                console.print(
                    f"[yellow]{bad} is damaged ({why}): resuming from {folder.name} instead; it is kept "
                    f"as {bad.name}.damaged[/]",
                    soft_wrap=True,
                )
                if main:
                    shutil.rmtree(bad.with_name(bad.name + ".damaged"), ignore_errors=True)
                    os.replace(bad, bad.with_name(bad.name + ".damaged"))
            return folder
        damaged.append((folder, "; ".join(problems)))
    if damaged:
        raise LoraclsError(
            f"{run_path} has no intact checkpoint to resume from: "
            + "; ".join(f"{folder.name}: {why}" for folder, why in damaged)
            + ". Start the run again."
        )
    return None


def check_log(run: RunFolder) -> None:
    """Before a resume truncates RUN/train_log.jsonl: a torn last line (a write cut short by a full disk or
    a kill) is dropped with a note; an unreadable line before the last is an error naming it."""
    log = run.file("train_log.jsonl")
    if not log.is_file():
        return
    lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
    for number, line in enumerate(lines, 1):
        try:
            json.loads(line)
        except json.JSONDecodeError:
            if number < len(lines):
                raise LoraclsError(
                    f"{log} line {number} is not JSON ({line[:60]!r}): the log is damaged; fix or remove "
                    "that line, then resume again"
                ) from None
            console.print(f"[yellow]{log.name}: dropped a torn last line ({line[:60]!r})[/]", soft_wrap=True)
            if run.main:
                write_text(log, "".join(lines[:-1]))
