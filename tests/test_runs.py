"""The run folder's lifecycle: `--out` refuses a folder that is not a run, one process writes a run at a
time (RUN/.lock), a signal anywhere in the run ends it as `interrupted`, a full disk ends it as `failed`
with a message that says what to free and how to continue, and RUN/best is never missing."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerFast

from loracls.files import atomic_folder
from loracls.training import checkpoints
from loracls.training.runs import RunFolder
from tests.conftest import invoke, toy_reviews
from tests.test_faults import LONG, outputs, start

# 96 training examples, micro-batch 4, 2 accumulated: 12 optimizer steps, checkpoints at 3, 4, 6, 8, 9, 12
SHORT = ["--epochs", "1", *LONG[2:]]

# `loracls train` (or another command) with one function of loracls.training.train paused (after touching a
# marker file), so that a real signal reaches the process in the middle of that stage; `Class.method` names a
# method. Ctrl-C raises KeyboardInterrupt as in a terminal, even where the tests run in a background job
# (whose children start with SIGINT ignored, and then Python keeps it ignored)
PAUSED = """
import importlib, signal, sys, time
signal.signal(signal.SIGINT, signal.default_int_handler)
module, name, marker = sys.argv[1:4]
target = importlib.import_module(module)
*owners, name = name.split(".")
for owner in owners:
    target = getattr(target, owner)
original = getattr(target, name)

def paused(*args, **kwargs):
    open(marker, "w").close()
    time.sleep(300)
    return original(*args, **kwargs)

setattr(target, name, paused)
from loracls.cli import app
sys.argv = ["loracls", *sys.argv[4:]]
app()
"""


def short_args(model: Path, data: Path, out: Path, *extra) -> list:
    return ["train", "--model", model, "--data", data, "--out", out, *SHORT, *extra]


def signal_during(
    stage: str, signal_number: int, args: list, tmp_path: Path, module: str = "loracls.training.train"
) -> tuple[int, str]:
    """Run `loracls train` with `<module>.<stage>` paused, send `signal_number` once it is reached;
    returns (exit code, stderr with the lines joined)."""
    marker = tmp_path / f"{stage}.reached"
    command = [sys.executable, "-c", PAUSED, module, stage, str(marker), *map(str, args)]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 180
    while not marker.exists():
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, f"{stage} was not reached"
        time.sleep(0.02)
    child.send_signal(signal_number)
    _, stderr = child.communicate(timeout=120)
    return child.returncode, " ".join(stderr.split())


def status(run: Path) -> dict:
    return json.loads((run / "status.json").read_text())


@pytest.fixture(scope="module")
def short_reference(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted short run of the Llama tiny model: (run folder, data)."""
    root = tmp_path_factory.mktemp("short")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    result = invoke(*short_args(tiny_models["llama"], data, root / "run"))
    assert result.exit_code == 0, result.output
    return root / "run", data


def test_out_refuses_a_folder_that_is_not_a_run(tiny_models, toy_csv, tmp_path):
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    own = "".join(json.dumps({"text": f"row {i}", "label": "a"}) + "\n" for i in range(300))
    (project / "data/train.jsonl").write_text(own)
    (project / "README.md").write_text("my project\n")
    result = invoke(*short_args(tiny_models["llama"], toy_csv, project))
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "is not empty and is not a loracls run (it holds README.md, data/)" in message
    assert (project / "data/train.jsonl").read_text() == own  # the user's 300 rows, untouched
    assert sorted(p.name for p in project.iterdir()) == ["README.md", "data"]

    a_file = tmp_path / "notes.txt"
    a_file.write_text("x")
    result = invoke(*short_args(tiny_models["llama"], toy_csv, a_file))
    assert result.exit_code == 2 and "is a file, not a folder" in result.output


def test_a_live_run_refuses_a_second_writer(tiny_models, toy_csv, tmp_path):
    """`--resume`, `--out` and `--overwrite` on a run another process is training are refused, naming it;
    the live run's log, checkpoints and status are left alone and it finishes."""
    out = tmp_path / "live"
    child = start(tiny_models["llama"], toy_csv, out)
    deadline = time.monotonic() + 180
    while not checkpoints.complete(out):
        assert child.poll() is None, child.communicate()
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.01)
    log_before = (out / "train_log.jsonl").read_text()
    holder = f"pid {child.pid} on host {socket.gethostname()}"
    assert (out / ".lock").read_text().strip() == holder
    for args in (
        ["train", "--resume", out],
        short_args(tiny_models["llama"], toy_csv, out),
        [*short_args(tiny_models["llama"], toy_csv, out), "--overwrite"],
    ):
        result = invoke(*args)
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and f"is being written by another loracls process ({holder})" in message
        assert (out / "train_log.jsonl").read_text().startswith(log_before)  # not truncated
        assert status(out)["state"] == "running"
    _, stderr = child.communicate(timeout=300)
    assert child.returncode == 0, stderr
    assert status(out)["state"] == "finished" and (out / "metrics.json").is_file()
    assert (out / ".lock").read_text() == ""  # released


def test_signal_while_loading_the_data_exits_130_and_writes_nothing(tiny_models, toy_csv, tmp_path):
    out = tmp_path / "run"
    code, stderr = signal_during(
        "load_splits", signal.SIGTERM, short_args(tiny_models["llama"], toy_csv, out), tmp_path
    )
    assert code == 130 and "Traceback" not in stderr
    assert "SIGTERM: stopped while loading the data; no run was started" in stderr
    assert not out.exists()


def test_signal_before_the_first_checkpoint_then_overwrite(tiny_models, toy_csv, tmp_path):
    """SIGINT while the model loads: `interrupted`, and the messages of the stop, of `--resume` and of a
    second `train --out` all say --overwrite, which then starts the run again in the same folder."""
    out = tmp_path / "run"
    args = short_args(tiny_models["llama"], toy_csv, out)
    code, stderr = signal_during("load_classifier", signal.SIGINT, args, tmp_path, "loracls.objective")
    assert code == 130 and "Traceback" not in stderr
    assert "SIGINT: stopped while loading the model; start it again (no checkpoint yet)" in stderr
    assert "--overwrite" in stderr
    assert status(out)["state"] == "interrupted" and "loading the model" in status(out)["error"]
    assert checkpoints.latest(out) is None

    result = invoke("train", "--resume", out)
    assert result.exit_code == 2 and "no complete checkpoint" in result.output
    assert "the same `loracls train` command with --overwrite" in " ".join(result.output.split())
    result = invoke(*args)
    assert result.exit_code == 2 and "start it again in this folder with --overwrite" in " ".join(
        result.output.split()
    )
    result = invoke(*args, "--overwrite")
    assert result.exit_code == 0, result.output
    assert status(out)["state"] == "finished" and (out / "metrics.json").is_file()
    result = invoke(*args, "--overwrite")
    assert result.exit_code == 2 and "holds a finished run" in result.output
    assert status(out)["state"] == "finished"


@pytest.mark.parametrize(
    ("stage", "number", "said"),
    [
        ("score_test_split", signal.SIGTERM, "SIGTERM: stopped while testing the best checkpoint"),
        ("build_report", signal.SIGINT, "SIGINT: stopped while writing the report"),
    ],
)
def test_signal_after_training_is_interrupted_and_resumes(
    short_reference, tiny_models, tmp_path, stage, number, said
):
    """A signal in the final test or the report (beside a complete metrics.json) leaves `interrupted`,
    not `running`; `--resume` then finishes with the uninterrupted run's results."""
    reference, data = short_reference
    out = tmp_path / "run"
    code, stderr = signal_during(stage, number, short_args(tiny_models["llama"], data, out), tmp_path)
    assert code == 130 and "Traceback" not in stderr
    assert f"{said}; `loracls train --resume {out}`" in stderr
    assert status(out)["state"] == "interrupted"
    assert (out / "metrics.json").is_file() == (stage == "build_report")

    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert status(out)["state"] == "finished" and (out / "report.html").is_file()
    assert outputs(out) == outputs(reference)


def disk_full_for(monkeypatch, *names: str) -> list[str]:
    """`os.replace` onto a file named in `names` fails as a full disk does; returns the names it failed."""
    replace, failed = os.replace, []

    def full(src, dst, *args, **kwargs):
        if Path(dst).name in names:
            failed.append(Path(dst).name)
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", full)
    return failed


def test_full_disk_in_the_report_fails_clearly_and_resumes(
    short_reference, monkeypatch, tiny_models, tmp_path
):
    reference, data = short_reference
    out = tmp_path / "empty"
    out.mkdir()  # an empty folder is a fine --out
    disk_full_for(monkeypatch, "curves.png")
    result = invoke(*short_args(tiny_models["llama"], data, out))
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    said = f"No space left on device writing {out}/plots/curves.png (while writing the report): "
    said += "free space, then "
    assert said + f"`loracls train --resume {out}`" in message
    assert status(out)["state"] == "failed" and status(out)["error"].startswith(said)
    assert not (out / "report.html").exists() and not (out / "plots/curves.png").exists()
    assert not list(out.rglob("*.tmp"))

    monkeypatch.undo()
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert status(out)["state"] == "finished" and (out / "plots/curves.png").stat().st_size > 0
    assert outputs(out) == outputs(reference)


def test_full_disk_before_a_checkpoint_and_for_the_status_says_both(
    monkeypatch, tiny_models, toy_csv, tmp_path
):
    out = tmp_path / "run"
    failed = disk_full_for(monkeypatch, "val.jsonl")
    replace = os.replace

    def status_too(src, dst, *args, **kwargs):  # once the disk is full, status.json cannot be written either
        if failed and Path(dst).name == "status.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", status_too)
    result = invoke(*short_args(tiny_models["llama"], toy_csv, out))
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"No space left on device writing {out}/data/val.jsonl" in message
    assert "start it again (no checkpoint yet): the same `loracls train` command with --overwrite" in message
    assert f"(and {out}/status.json could not be written either: No space left on device" in message
    assert status(out)["state"] == "running"  # the status.json written before the disk filled, whole


def test_tokenizers_full_disk_error_in_best_is_translated_and_resumes(
    monkeypatch, tiny_models, toy_csv, tmp_path
):
    """tokenizers raises a plain `Exception("No space left on device (os error 28)")`: recognised by its
    message; RUN/best keeps the previous best and the run resumes from its checkpoint."""
    save, calls = PreTrainedTokenizerFast._save_pretrained, []

    def full(self, *args, **kwargs):
        folder = Path(kwargs.get("save_directory") or args[0])
        if folder.name == "best.tmp":
            calls.append(folder)
            if len(calls) == 2:
                raise Exception("No space left on device (os error 28)")
        return save(self, *args, **kwargs)

    monkeypatch.setattr(PreTrainedTokenizerFast, "_save_pretrained", full)
    out = tmp_path / "run"
    result = invoke(*short_args(tiny_models["llama"], toy_csv, out))
    message = " ".join(result.output.split())
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert f"No space left on device writing a file in {out} (while training): free space, then " in message
    assert f"`loracls train --resume {out}`" in message
    assert status(out)["state"] == "failed" and (out / "best/adapter_model.safetensors").is_file()

    monkeypatch.undo()
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert status(out)["state"] == "finished"


def test_replacing_best_leaves_a_whole_folder_at_every_moment(monkeypatch, tmp_path):
    """A stop between the renames of RUN/best leaves the old one aside, and a run puts it back."""
    run = RunFolder(tmp_path)
    run.best.mkdir()
    (run.best / "adapter_model.safetensors").write_text("old")
    replace = os.replace

    def stop_before_the_new_one_is_in(src, dst, *args, **kwargs):
        if Path(src).name == "best.tmp":
            raise KeyboardInterrupt
        return replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "replace", stop_before_the_new_one_is_in)
    with pytest.raises(KeyboardInterrupt), atomic_folder(run.best) as tmp:
        (tmp / "adapter_model.safetensors").write_text("new")
    assert (tmp_path / "best.old/adapter_model.safetensors").read_text() == "old"
    monkeypatch.undo()
    run.recover()
    assert (run.best / "adapter_model.safetensors").read_text() == "old" and not (
        tmp_path / "best.old"
    ).exists()

    with atomic_folder(run.best) as tmp:
        (tmp / "adapter_model.safetensors").write_text("new")
    assert (run.best / "adapter_model.safetensors").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["best"]


def tmpfs(folder: Path, size: str) -> bool:
    folder.mkdir(parents=True, exist_ok=True)
    if shutil.which("mount") is None:
        return False
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True
    )
    return done.returncode == 0


def test_a_real_full_disk_fails_clearly_and_resumes_once_freed(short_reference, tiny_models, tmp_path):
    """A small tmpfs: the run fills it, whatever write that hits (a plot, torch's checkpoint, safetensors,
    status.json) ends with the one message and no partial file; with space, `--resume` finishes."""
    reference, data = short_reference
    disk = tmp_path / "disk"
    if not tmpfs(disk, "300k"):
        pytest.skip("mounting a tmpfs is not permitted here")
    try:
        out = disk / "run"
        result = invoke(*short_args(tiny_models["llama"], data, out))
        message = " ".join(result.output.split())
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        # a checkpoint's own message (loracls.training.checkpoints) or the run's: both say what to do
        assert "No space left on device" in message and "free space, then " in message.lower()
        assert f"`loracls train --resume {out}`" in message
        assert status(out)["state"] in ("failed", "running")
        if status(out)["state"] == "running":
            assert "status.json could not be written either" in message
        assert not (out / "report.html").exists() or status(out)["state"] != "finished"
        assert not [p for p in out.rglob("*") if p.is_file() and p.stat().st_size == 0 and p.name != ".lock"]

        subprocess.run(["mount", "-o", "remount,size=16m", str(disk)], check=True)
        result = invoke("train", "--resume", out)
        assert result.exit_code == 0, result.output
        assert status(out)["state"] == "finished" and (out / "report.html").stat().st_size > 0
        assert outputs(out) == outputs(reference)
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


@pytest.mark.parametrize(
    "name, text, command",
    [
        ("status.json", '{"state": "runn', "predict"),
        ("status.json", '["finished"]', "resume"),
        ("labels.json", '{"id2label": {"0": "negative"', "predict"),
        ("labels.json", '{"label2id": {}}', "predict"),
        ("data/notes.json", "", "resume"),
    ],
)
def test_a_damaged_run_file_is_an_error_naming_it(name, text, command, trained, tmp_path):
    """A torn or edited JSON file of the run folder ends in a message naming it (exit 2), not a traceback."""
    run = tmp_path / "run"
    shutil.copytree(trained["llama"][0], run)
    if command == "resume":  # a run that can be resumed: interrupted, with its checkpoints
        RunFolder(run).set_status("interrupted")
        args = ["train", "--resume", run]
    else:
        args = ["predict", run, "good"]
    (run / name).write_text(text, encoding="utf-8")
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert str(run / name) in " ".join(result.output.split()), result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("objective", ["head", "lm"])
def test_config_yaml_is_written_once_resolved_before_training(objective, tiny_models, tmp_path, monkeypatch):
    """What a run decides for itself (the prompt, the head's start or the chat template, the micro-batch) is
    decided before training, and config.yaml is written once, with all of it, before `fit()` starts."""
    import yaml

    from loracls.training import train

    out, data = tmp_path / "run", tmp_path / "reviews.csv"
    toy_reviews(64).to_csv(data, index=False)
    writes, seen = [], {}
    original = RunFolder.write_config

    def counted(self, cfg):
        writes.append(cfg.to_dict())
        original(self, cfg)

    def no_training(*args, **kwargs):
        seen["config"] = yaml.safe_load((out / "config.yaml").read_text())
        raise KeyboardInterrupt("stopped by the test")

    monkeypatch.setattr(RunFolder, "write_config", counted)
    monkeypatch.setattr(train, "fit", no_training)
    options = ["--epochs", "1", "--batch-size", "8", "--max-length", "64", "--no-baseline"]
    options += ["--objective", objective]
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *options)
    assert result.exit_code != 0 and "stopped by the test" in result.output, result.output
    assert len(writes) == 1, writes
    config = seen["config"]
    assert config == writes[0]
    assert config["micro_batch_size"] is not None
    if objective == "head":
        assert config["head_init"] in ("zero", "verbalizer")
        assert config["head_init"] == "zero" or config["prompt"] != "auto"
    else:
        assert config["prompt"] != "auto" and config["chat_template"] is not None
