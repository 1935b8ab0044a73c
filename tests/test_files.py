"""Atomic writes and the once-only model cache, including two processes that ask at the same moment."""

from __future__ import annotations

import json
import multiprocessing
import os
import time
from pathlib import Path

import pytest

from loracls.files import atomic_folder, build_once, write_text


def slow_build(log: Path):
    def build(folder: Path) -> None:
        with log.open("a") as f:
            f.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # long enough for the other process to arrive while this one converts
        (folder / "weights.bin").write_bytes(b"x" * 1000)
        (folder / "config.json").write_text(json.dumps({"built_by": os.getpid()}))

    return build


def convert_in_a_process(target: str, log: str, barrier, results) -> None:
    barrier.wait()
    folder, built = build_once(Path(target), slow_build(Path(log)))
    results.put((str(folder), built, json.loads((folder / "config.json").read_text())["built_by"]))


def test_two_processes_with_an_empty_cache_convert_once_and_both_load_it(tmp_path):
    """The ranks of `torchrun` all resolve the default model: one converts, the other waits and reads it
    (before, both wrote the same `.partial` folder, deleting each other's files)."""
    context = multiprocessing.get_context("spawn")
    barrier, results = context.Barrier(2), context.Queue()
    target, log = tmp_path / "cache/models/gemma", tmp_path / "builds.log"
    workers = [
        context.Process(target=convert_in_a_process, args=(str(target), str(log), barrier, results))
        for _ in range(2)
    ]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=60)
        assert worker.exitcode == 0
    found = [results.get(timeout=5) for _ in workers]
    assert len(log.read_text().splitlines()) == 1  # one conversion
    assert sorted(built for _, built, _ in found) == [False, True]
    assert {folder for folder, _, _ in found} == {str(target)} and len({by for _, _, by in found}) == 1
    assert sorted(p.name for p in target.parent.iterdir()) == ["gemma", "gemma.lock"]  # no .partial left


def test_a_failed_build_leaves_no_folder_and_the_next_call_builds(tmp_path):
    target = tmp_path / "model"

    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        build_once(target, broken)
    assert not target.exists() and not target.with_name("model.partial").exists()
    assert build_once(target, lambda folder: (folder / "config.json").write_text("{}")) == (target, True)
    assert build_once(target, broken) == (target, False)  # complete: not built again


def test_atomic_writes_keep_the_old_version_on_failure(tmp_path):
    path = tmp_path / "metrics.json"
    write_text(path, "old")
    write_text(path, "new")
    assert path.read_text() == "new" and not path.with_name("metrics.json.tmp").exists()
    folder = tmp_path / "best"
    with atomic_folder(folder) as tmp:
        (tmp / "a").write_text("1")
    with pytest.raises(RuntimeError), atomic_folder(folder) as tmp:
        (tmp / "a").write_text("2")
        raise RuntimeError("killed half way")
    assert (folder / "a").read_text() == "1" and sorted(p.name for p in tmp_path.iterdir()) == [
        "best",
        "metrics.json",
    ]
