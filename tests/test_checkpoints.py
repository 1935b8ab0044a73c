"""Checkpoints a resume can trust: a resume under other settings, data or processes is refused saying what
changed; a damaged checkpoint is never chosen (the previous intact one is, saying so); a torn log line is
dropped; a checkpoint that fills the disk leaves nothing behind; a DDP resume logs the loss it would have."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from loracls.training import checkpoints
from tests.conftest import invoke, toy_reviews
from tests.test_faults import LONG, outputs

# the faults' run, keeping the last three checkpoints (42, 45, 48) besides the best
KEEP_THREE = [*LONG[: LONG.index("--keep-checkpoints")], "--keep-checkpoints", "3", "--min-steps", "0"]


@pytest.fixture(scope="module")
def finished(tiny_models, tmp_path_factory) -> tuple[Path, Path]:
    """An uninterrupted run: (run folder, data)."""
    root = tmp_path_factory.mktemp("finished")
    data = root / "reviews.csv"
    toy_reviews(120).to_csv(data, index=False)
    out = root / "run"
    result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *KEEP_THREE)
    assert result.exit_code == 0, result.output
    assert [p.name for p in checkpoints.complete(out)][-3:] == ["step_000042", "step_000045", "step_000048"]
    return out, data


def with_values(options: list, values: dict[str, str]) -> list:
    """`options` with the values of some of them changed."""
    changed = list(options)
    for name, value in values.items():
        changed[changed.index(name) + 1] = value
    return changed


def stopped_copy(run: Path, where: Path, after: int) -> Path:
    """A copy of `run` as if its process had been killed after the checkpoint of step `after`."""
    copy = shutil.copytree(run, where)
    for folder in checkpoints.complete(copy):
        if int(folder.name[5:]) > after:
            shutil.rmtree(folder)
    (copy / "status.json").write_text(json.dumps({"state": "interrupted"}))
    return copy


def said(result) -> str:
    return " ".join(result.output.split())


def test_resume_refuses_an_edited_config_naming_the_fields(finished, tmp_path):
    run, _ = finished
    out = stopped_copy(run, tmp_path / "run", 45)
    config = yaml.safe_load((out / "config.yaml").read_text())
    log = (out / "train_log.jsonl").read_text()
    edited = config | {"batch_size": 16, "lr": 1e-3}
    (out / "config.yaml").write_text(yaml.safe_dump(edited, sort_keys=False))
    result = invoke("train", "--resume", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = said(result)
    assert "step_000045 was trained with other settings" in message
    assert "batch_size: 8 in the checkpoint, 16 in config.yaml" in message
    assert "lr: 0.005 in the checkpoint, 0.001 in config.yaml" in message
    # nothing was touched: the status, the log and the checkpoints are as the stopped run left them
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"
    assert (out / "train_log.jsonl").read_text() == log
    assert checkpoints.latest(out).name == "step_000045"

    (out / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))  # put back: resumes as before
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert outputs(out) == outputs(run)


def test_resume_refuses_a_cut_training_split(finished, tmp_path):
    run, _ = finished
    out = stopped_copy(run, tmp_path / "run", 45)
    lines = (out / "data/train.jsonl").read_text().splitlines(keepends=True)
    (out / "data/train.jsonl").write_text("".join(lines[:-10]))  # cut at a line boundary: still valid JSONL
    result = invoke("train", "--resume", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "data/train.jsonl is not the file step_000045 was trained on" in said(result)
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"


DAMAGE = {
    "trainer_state.json": lambda p: p.write_text('{"total_steps": 48, "st'),
    "adapter/adapter_config.json": lambda p: p.write_text("{"),
    "adapter/adapter_model.safetensors": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2]),
    "optimizer.bin": lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size - 100]),
    "random_states_0.pkl": lambda p: p.write_bytes(p.read_bytes()[:50]),
    "scheduler.bin": lambda p: p.unlink(),
}


@pytest.mark.parametrize("name", DAMAGE)
def test_a_damaged_latest_checkpoint_falls_back_to_the_previous_one(finished, tmp_path, name):
    run, _ = finished
    out = stopped_copy(run, tmp_path / "run", 45)
    DAMAGE[name](out / "checkpoints/step_000045" / name)
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    message = said(result)
    assert f"checkpoints/step_000045 is damaged ({name}" in message
    assert "resuming from step_000042 instead" in message and "from step_000042" in message
    assert (out / "checkpoints/step_000045.damaged" / name).exists() or name == "scheduler.bin"
    assert outputs(out) == outputs(run)  # the steps after 42 done again, as they were


def test_no_intact_checkpoint_is_an_error_naming_the_files(finished, tmp_path):
    run, _ = finished
    out = stopped_copy(run, tmp_path / "run", 45)
    for folder in checkpoints.complete(out):
        (folder / "random_states_0.pkl").unlink()
    result = invoke("train", "--resume", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    message = said(result)
    assert "no intact checkpoint to resume from" in message
    assert "step_000045: random_states_0.pkl is missing" in message
    assert "step_000042: random_states_0.pkl is missing" in message
    assert json.loads((out / "status.json").read_text())["state"] == "interrupted"


def test_a_torn_last_log_line_is_dropped_with_a_note(finished, tmp_path):
    run, _ = finished
    out = stopped_copy(run, tmp_path / "run", 45)
    with (out / "train_log.jsonl").open("a") as f:
        f.write('{"kind": "train", "step": 4')  # the disk filled up in the middle of a line
    result = invoke("train", "--resume", out)
    assert result.exit_code == 0, result.output
    assert "train_log.jsonl: dropped a torn last line" in said(result)
    assert outputs(out) == outputs(run)


def test_a_torn_line_inside_the_log_is_an_error(finished, tmp_path):
    run, _ = finished
    out = stopped_copy(run, tmp_path / "run", 45)
    lines = (out / "train_log.jsonl").read_text().splitlines(keepends=True)
    lines[3] = lines[3][:10] + "\n"
    (out / "train_log.jsonl").write_text("".join(lines))
    result = invoke("train", "--resume", out)
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "train_log.jsonl line 4 is not JSON" in said(result)


def mount_tmpfs(folder: Path, size: str) -> None:
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)])
    if done.returncode != 0:
        pytest.skip("needs to mount a small tmpfs (root) to fill a disk for real")


def test_a_checkpoint_that_fills_the_disk_leaves_no_tmp_and_says_so(
    finished, tiny_models, tmp_path, monkeypatch
):
    """RUN/checkpoints on a small tmpfs that fills during a checkpoint: torch.save raises a RuntimeError
    that does not say why; the checkpoint path says "No space left on device" and removes its .tmp."""
    from loracls.training.runs import RunFolder

    run, data = finished
    disk = tmp_path / "disk"
    mount_tmpfs(disk, "2m")
    opened = RunFolder.open

    def open_with_checkpoints_on_the_small_disk(self: RunFolder) -> None:
        opened(self)  # `--out` must be empty or a run: the link goes in once the run holds the folder
        (self.path / "checkpoints").symlink_to(disk)

    monkeypatch.setattr(RunFolder, "open", open_with_checkpoints_on_the_small_disk)
    try:
        out = tmp_path / "run"
        # the first checkpoints fit; a filler leaves less than one more needs
        files = [f for f in (run / "checkpoints/step_000048").rglob("*") if f.is_file()]
        checkpoint = sum(-(-f.stat().st_size // 4096) * 4096 for f in files)  # in whole pages, as tmpfs
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        (disk / "filler").write_bytes(b"\0" * (free - int(2.5 * checkpoint)))
        options = with_values(KEEP_THREE, {"--eval-every": "100", "--keep-checkpoints": "5"})
        result = invoke("train", "--model", tiny_models["llama"], "--data", data, "--out", out, *options)
        assert result.exit_code == 2 and "Traceback" not in result.output
        message = said(result)
        assert "Could not write the checkpoint of step 9" in message and "No space left on device" in message
        assert sorted(p.name for p in disk.iterdir()) == ["filler", "step_000003", "step_000006"]
        status = json.loads((out / "status.json").read_text())
        assert status["state"] == "failed" and "No space left on device" in status["error"]

        (disk / "filler").unlink()  # space freed
        result = invoke("train", "--resume", out)
        assert result.exit_code == 0 and "from step_000006" in said(result), result.output
    finally:
        subprocess.run(["umount", "-l", str(disk)])
