"""Training checkpoints: everything needed to continue a run exactly where it stopped.

RUN/checkpoints/step_NNNNNN/
    adapter/                   LoRA matrices and the trained head (PEFT, safetensors)
    optimizer.bin, scheduler.bin, random_states_0.pkl
                               `Accelerator.save_state`: AdamW moments, schedule, RNG states
    trainer_state.json         `TrainerState`: step, position in the data, best so far, counters
    pytorch_model_fsdp_0/, optimizer_0/
                               under FSDP instead of optimizer.bin: the sharded model and optimizer state
                               (accelerate saves the whole sharded model, frozen base weights included)

A checkpoint is written into `step_NNNNNN.tmp` and renamed when whole, so a folder without `.tmp` is always
complete and a failed write (disk full, a kill) leaves the previous checkpoints as they were.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from peft import PeftModel, set_peft_model_state_dict
from peft.utils import load_peft_weights
from transformers import PreTrainedTokenizerBase

from loracls.errors import LoraclsError
from loracls.files import atomic_folder
from loracls.runs import RunFolder

FOLDER = "checkpoints"
STATE_FILE = "trainer_state.json"
ADAPTER = "adapter"


@dataclass
class TrainerState:
    """`fit()`'s counters: saved with every checkpoint and restored by `--resume`."""

    total_steps: int
    """Optimizer steps the run will take (lowered when early stopping ends it)."""
    step: int = 0
    """Optimizer steps taken."""
    epoch: int = 0
    """Pass over the training data in progress (its batch order is seeded by `seed + epoch`)."""
    batches_in_epoch: int = 0
    """Micro-batches of `epoch` already consumed; a resumed run skips them."""
    best_step: int = 0
    best_val: dict | None = None
    """Validation metrics of the best step so far."""
    stale: int = 0
    """Validations since the last improvement (for early stopping)."""
    skipped_nonfinite: int = 0
    """Optimizer steps skipped because the loss or gradient was NaN or infinite."""
    examples: int = 0
    tokens: int = 0
    train_s: float = 0.0
    """Examples, real tokens and seconds of training so far (validation excluded)."""
    window_loss: float = 0.0
    window_micro: int = 0
    window_examples: int = 0
    window_tokens: int = 0
    window_s: float = 0.0
    """The log window in progress: summed loss, micro-batches, examples, tokens and seconds."""


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


def save(accelerator: Accelerator, state: TrainerState, run_path: Path, keep: int) -> Path:
    """Write a checkpoint of `state.step` atomically, then keep only the last `keep` and the best.

    Every process calls this (each saves its own RNG state); the main one writes the rest and renames.
    """
    main = accelerator.is_main_process
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
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        accelerator.wait_for_everyone()
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest(run_path)
        raise LoraclsError(
            f"Could not write the checkpoint of step {state.step} to {final}: {e}. "
            f"The previous checkpoint is intact: {previous or 'none yet'}. Free space, then "
            f"`loracls train --resume {run_path}`."
        ) from None
    for old in complete(run_path)[:-keep] if main else []:
        if old.name != step_folder(run_path, state.best_step).name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load(accelerator: Accelerator, folder: Path) -> TrainerState:
    """Restore adapter, optimizer, scheduler and RNG from `folder`; return its `TrainerState`."""
    accelerator.load_state(str(folder))
    return TrainerState(**json.loads((folder / STATE_FILE).read_text(encoding="utf-8")))


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
