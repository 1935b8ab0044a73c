"""The run folder: the files every run writes, and reading a finished run back.

RUN/config.yaml         resolved TrainConfig
RUN/env.json            versions, backend and device
RUN/labels.json         id2label / label2id
RUN/status.json         running, then finished (only after metrics.json exists), interrupted or failed
RUN/.lock               pid and host of the process writing the run, held (flock) while it runs
RUN/data/{train,val,test}.jsonl, notes.json  the splits as trained and scored (`--resume`, `eval` read them)
RUN/targets.json        the modules that got LoRA and the trainable parameter counts
RUN/train_log.jsonl     one line per log step and per validation
RUN/val_predictions/step_NNNNNN.jsonl
RUN/best/               adapter + head (PEFT) + tokenizer of the best validation step
RUN/checkpoints/step_NNNNNN/  full training state (`loracls.training.checkpoints`): the last few and the best
RUN/test_predictions.jsonl
RUN/metrics.json
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import shutil
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch
import yaml

from loracls.config import TrainConfig
from loracls.console import console
from loracls.data.splits import Splits
from loracls.environment.doctor import package_version
from loracls.errors import LoraclsError
from loracls.files import recover_folder, write_text

LOCK = ".lock"


@dataclass
class RunFolder:
    path: Path
    main: bool = True
    """Whether this process writes: under several processes only the main one does; the others' writes are
    no-ops, so the training code reads the same for one process or many."""

    def __post_init__(self) -> None:
        self.path = Path(self.path)
        self.lock_file = None
        self._stage, self._stage_started = "starting", time.monotonic()
        self.stage_seconds: dict[str, float] = {}
        """Seconds spent in each stage that has ended, in the order the stages ran (metrics.json's
        `stages`)."""

    @property
    def stage(self) -> str:
        """What the run is doing, for the message when a signal or an error stops it; setting it ends the
        stage before (its time goes to `stage_seconds`)."""
        return self._stage

    @stage.setter
    def stage(self, name: str) -> None:
        now = time.monotonic()
        spent = self.stage_seconds.get(self._stage, 0.0) + now - self._stage_started
        self.stage_seconds[self._stage] = round(spent, 2)
        self._stage, self._stage_started = name, now

    @classmethod
    def create(cls, out: str | None, data: str, main: bool = True, overwrite: bool = False) -> RunFolder:
        """The run folder at `out` (default `runs/<data>-<timestamp>`), checked; `open()` then takes it.

        Refuses a folder that holds a run (with `overwrite`: one that finished, or one still running) and a
        non-empty folder that is not a run: training writes data/, best/, config.yaml... into it."""
        path = Path(out or default_out(data))
        run = cls(path, main)
        if path.exists() and not path.is_dir():
            raise LoraclsError(f"--out {path} is a file, not a folder; choose another --out")
        holds_run = (path / "status.json").exists() or (path / LOCK).exists()
        if holds_run and run.holder():
            raise run.in_use(run.holder())
        if holds_run and not overwrite:
            raise LoraclsError(
                f"{path} already holds a run (status: {run.status()}); continue it with `loracls train "
                f"--resume {path}`, start it again in this folder with --overwrite, or choose another --out"
            )
        if holds_run and run.status() == "finished":
            raise LoraclsError(f"{path} holds a finished run; --overwrite replaces unfinished runs only")
        if path.is_dir() and not holds_run and any(path.iterdir()):
            names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
            shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
            raise LoraclsError(
                f"--out {path} is not empty and is not a loracls run (it holds {shown}); training would "
                "write data/, best/, config.yaml and more into it. Choose a new or empty folder for --out."
            )
        return run

    def open(self) -> None:
        """After every process has checked the folder (`create`): make it, take its lock, and empty it of
        the unfinished run `--overwrite` replaces."""
        if not self.main:
            return
        self.path.mkdir(parents=True, exist_ok=True)
        self.lock()
        if self.status() == "finished":  # finished since `create` looked
            self.unlock()
            raise LoraclsError(f"{self.path} holds a finished run; --overwrite replaces unfinished runs only")
        for entry in self.path.iterdir():
            if entry.name != LOCK:
                shutil.rmtree(entry) if entry.is_dir() and not entry.is_symlink() else entry.unlink()

    def holder(self) -> str | None:
        """Who holds `RUN/.lock` now ("pid N on host H"), or None when no live process does."""
        path = self.path / LOCK
        if not path.is_file():
            return None
        with path.open(encoding="utf-8") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return f.read().strip() or "pid unknown"
        return None

    def in_use(self, holder: str) -> LoraclsError:
        return LoraclsError(
            f"{self.path} is being written by another loracls process ({holder}); wait for it to end, or "
            "stop it (SIGINT or SIGTERM: it writes a checkpoint), then try again"
        )

    def lock(self) -> None:
        """Hold `RUN/.lock` until `unlock()` or this process ends: one process writes a run at a time.

        The lock is an flock, which the kernel drops when its process dies; the file names the holder, so a
        lock left by a killed process is recognised (and taken over), and a live one is named."""
        if not self.main:
            return
        path = self.path / LOCK
        f = path.open("a+", encoding="utf-8")
        f.seek(0)
        holder = f.read().strip()
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise self.in_use(holder or "pid unknown") from None
        host = socket.gethostname()
        if holder and not holder.endswith(f"on host {host}"):
            f.close()
            raise LoraclsError(
                f"{path} names {holder}, on another machine, which may still be writing this run; if that "
                f"run has ended, remove {path} and try again"
            )
        if holder:
            console.print(f"[dim]{path}: the lock of {holder} is stale (that process ended); taken over[/]")
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()} on host {host}\n")
        f.flush()
        self.lock_file = f

    def unlock(self) -> None:
        """Release `RUN/.lock`: emptied, then unlocked (an empty lock file is a free one)."""
        if self.lock_file is None:
            return
        self.lock_file.seek(0)
        self.lock_file.truncate()
        self.lock_file.close()
        self.lock_file = None

    def recover(self) -> None:
        """Put back what a stop in the middle of replacing RUN/best left aside."""
        if self.main:
            recover_folder(self.best)

    def file(self, name: str) -> Path:
        return self.path / name

    @property
    def best(self) -> Path:
        return self.path / "best"

    def write_json(self, name: str, value: Any) -> None:
        if self.main:
            write_json(self.path / name, value)

    def record_environment(self, env: dict[str, Any], resume: Path | None = None) -> None:
        """`env.json`: the environment of the run; a resume keeps the first and appends its own, with the
        checkpoint it continued from, under `resumes`."""
        if resume is None:
            self.write_json("env.json", env)
            return
        first = read_json(self.file("env.json"))
        first.setdefault("resumes", []).append({"from": str(resume), **env})
        self.write_json("env.json", first)

    def append_log(self, record: dict) -> None:
        """One line appended (a full disk can leave half of the last line; `truncate_log` drops it)."""
        if not self.main:
            return
        with (self.path / "train_log.jsonl").open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")

    def write_config(self, cfg: TrainConfig) -> None:
        if self.main:
            write_text(self.path / "config.yaml", yaml.safe_dump(cfg.to_dict(), sort_keys=False))

    def set_status(self, state: str, **extra: Any) -> None:
        self.write_json("status.json", {"state": state, "time": time.strftime("%Y-%m-%dT%H:%M:%S"), **extra})

    def status(self) -> str | None:
        """The `state` in RUN/status.json, or None when the folder holds no run."""
        status_file = self.path / "status.json"
        if not status_file.is_file():
            return None
        status = read_json(status_file, 'rewrite it as {"state": "interrupted"} to resume the run')
        if not isinstance(status, dict) or not isinstance(status.get("state"), str):
            raise LoraclsError(
                f'{status_file} has no "state"; rewrite it as {{"state": "interrupted"}} to resume the run'
            )
        return status["state"]

    def truncate_log(self, step: int) -> None:
        """Drop `train_log.jsonl` records after `step` (a resumed run writes them again)."""
        log = self.path / "train_log.jsonl"
        if self.main and log.is_file():
            lines = log.read_text(encoding="utf-8").splitlines(keepends=True)
            whole = [line for line in lines if line.endswith("\n") and line.strip()]
            kept = [line for line in whole if json.loads(line)["step"] <= step]
            write_text(log, "".join(kept))

    def read_splits(self) -> Splits:
        """The train/val/test tables and labels a run was started with."""
        notes = read_json(self.path / "data" / "notes.json")
        tables = [self.read_split(name) for name in ("train", "val", "test")]
        return Splits(*tables, labels=self.read_labels(), notes=notes)

    def read_config(self) -> TrainConfig:
        return TrainConfig.load(self.path / "config.yaml", written=True)

    def read_labels(self) -> list[str]:
        file = self.path / "labels.json"
        try:
            id2label = read_json(file)["id2label"]
            return [id2label[str(i)] for i in range(len(id2label))]
        except (KeyError, TypeError) as e:
            raise LoraclsError(
                f"{file} is damaged: it must map each label id 0..N-1 to its label under id2label "
                f"({type(e).__name__}: {e})"
            ) from None

    def read_split(self, name: str) -> pd.DataFrame:
        """A split as written: string labels, or tuples of them in a multi-label task."""
        table = pd.read_json(self.path / "data" / f"{name}.jsonl", lines=True, dtype=False)
        table["id"] = table["id"].astype(str)
        table["label"] = [tuple(v) if isinstance(v, list) else str(v) for v in table["label"]]
        return table

    def check_finished(self, allow_unfinished: bool = False) -> None:
        """Refuse a folder that is not a run, or a run that did not finish (unless `allow_unfinished`)."""
        state = self.status()
        if state is None:
            raise LoraclsError(f"{self.path} is not a loracls run folder (no status.json)")
        has_best = (self.best / "adapter_config.json").is_file()
        if state == "finished" and has_best:
            return
        if not allow_unfinished:
            raise LoraclsError(
                f"{self.path} did not finish (status: {state}). Continue it with `loracls train --resume "
                f"{self.path}`, or pass --allow-unfinished to use its best checkpoint so far."
            )
        if not has_best:
            raise LoraclsError(f"{self.path} (status: {state}) has no best checkpoint yet: no validation ran")


def default_out(data: str) -> str:
    return f"runs/{Path(data).stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def read_json(path: Path, fix: str | None = None) -> Any:
    """A JSON file of the run folder; a missing, unreadable or damaged one is a `LoraclsError` naming it."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise LoraclsError(f"{path} is missing from the run folder{'; ' + fix if fix else ''}") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoraclsError(f"{path} is damaged ({e}){'; ' + fix if fix else ''}") from None


def write_json(path: Path, value: Any) -> None:
    write_text(path, json.dumps(value, indent=2, ensure_ascii=False) + "\n")


def write_jsonl(path: Path, table: pd.DataFrame) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text(path, table.to_json(orient="records", lines=True, force_ascii=False))


def device_info(device: torch.device) -> dict[str, Any]:
    """Backend and device; on ROCm, torch says "cuda" but HIP runs underneath."""
    info: dict[str, Any] = {"device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(
            backend="rocm" if torch.version.hip else "cuda",
            name=props.name,
            memory_gb=round(props.total_memory / 2**30, 1),
            arch=getattr(props, "gcnArchName", None) or f"sm_{props.major}{props.minor}",
        )
    elif device.type == "mps":
        info.update(backend="mps", name="Apple GPU")
    else:
        info.update(
            backend="cpu", name=platform.processor() or platform.machine(), threads=torch.get_num_threads()
        )
    return info


def environment(device: torch.device) -> dict[str, Any]:
    """What `RUN/env.json` records: the versions that decide whether a run can be reproduced."""
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_hip": torch.version.hip,
        "torch_cuda": torch.version.cuda,
        **{
            name: package_version(name)
            for name in ("transformers", "peft", "accelerate", "datasets", "loracls")
        },
        "bitsandbytes": package_version("bitsandbytes"),
        "hsa_override_gfx_version": os.environ.get("HSA_OVERRIDE_GFX_VERSION"),
        **device_info(device),
    }
