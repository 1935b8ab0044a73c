"""Writing files and folders so that a reader never sees half of one.

Everything loracls writes for later (run files, checkpoints, RUN/best, exports, the model cache) goes through
here: written under a temporary name beside the target, flushed to disk, then renamed over it in one step. A
failure (disk full, a kill) leaves the previous version, or nothing, and never a file or folder that looks
complete.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock


def write_text(path: Path, text: str) -> None:
    """`path` holds `text`, or what it held before: written to `path.tmp`, fsynced, renamed over `path`."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


@contextlib.contextmanager
def atomic_folder(target: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; when the block ends without an error it replaces
    `target` (the old one is removed just before), otherwise it is removed and `target` is left as it was."""
    tmp = target.with_name(target.name + suffix)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)


def build_once(
    target: Path, build: Callable[[Path], None], complete: str = "config.json"
) -> tuple[Path, bool]:
    """Make the cached folder `target` with `build(folder)` unless it exists (`target/complete` is there).

    Several processes (the ranks of `torchrun`, or two launches on one machine) may ask at once with an empty
    cache: a lock file beside `target` lets the first one build while the others wait, and then they read
    what it built. Returns the folder and whether this call built it.
    """
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.with_name(target.name + ".lock"))):
        if (target / complete).is_file():
            return target, False
        with atomic_folder(target, ".partial") as tmp:
            build(tmp)
    return target, True
