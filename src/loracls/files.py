"""Writing files and folders so that a reader never sees half of one.

Everything loracls writes for later (run files, checkpoints, RUN/best, exports, the model cache) goes through
here: written under a temporary name beside the target, flushed to disk, then renamed over it in one step. A
failure (disk full, a kill) leaves the previous version, or nothing, and never a file or folder that looks
complete.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

from filelock import FileLock


def write_text(path: Path, text: str) -> None:
    """`path` holds `text`, or what it held before: written to `path.tmp`, fsynced, renamed over `path`."""
    write_bytes(path, text.encode("utf-8"))


def write_bytes(path: Path, data: bytes) -> None:
    """`path` holds `data`, or what it held before. An error names `path`, not the temporary file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        raise OSError(e.errno, e.strerror or str(e), str(path)) from e
    finally:
        tmp.unlink(missing_ok=True)


def no_space(error: BaseException) -> bool:
    """Whether `error` (or what it wraps) is a full disk: an OSError with ENOSPC, torch's RuntimeError around
    one, or tokenizers' plain Exception, which keeps only the message."""
    while error is not None:
        if getattr(error, "errno", None) == errno.ENOSPC or "No space left on device" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def disk_full(folder: Path) -> bool:
    """Whether the disk holding `folder` is (nearly) full: torch's writer reports ENOSPC only as
    "unexpected pos N vs M", so an error while the disk is full is taken as the full disk."""
    folder = Path(folder)
    while not folder.exists() and folder != folder.parent:  # a temporary folder that was never made
        folder = folder.parent
    try:
        return shutil.disk_usage(folder).free < 2**20
    except OSError:
        return False


def written_file(error: BaseException) -> str | None:
    """The file an OSError in `error`'s chain names, if any."""
    while error is not None:
        if getattr(error, "filename", None):
            return str(error.filename)
        error = error.__cause__ or error.__context__
    return None


@contextlib.contextmanager
def atomic_folder(target: Path, suffix: str = ".tmp") -> Iterator[Path]:
    """Yield an empty temporary folder beside `target`; when the block ends without an error it replaces
    `target`, otherwise it is removed and `target` is left as it was.

    The old `target` is renamed aside (`target.old`), the new one renamed in, then the old one removed: at
    every moment one complete folder is there, under its own name or aside (`recover_folder` puts it back).
    """
    tmp = target.with_name(target.name + suffix)
    old = target.with_name(target.name + ".old")
    recover_folder(target)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        os.replace(target, old)
    os.replace(tmp, target)
    shutil.rmtree(old, ignore_errors=True)


def share_as_umask_allows(folder: Path) -> None:
    """Give every file under `folder` the mode a plain `open()` would (0o666 less the umask): libraries that
    write through temporary files leave 0o600 (transformers' `model.safetensors`), which other users of a
    shared machine cannot read."""
    mask = os.umask(0)
    os.umask(mask)
    for path in Path(folder).rglob("*"):
        if path.is_file() and not path.is_symlink():
            path.chmod(0o666 & ~mask)


def recover_folder(target: Path) -> None:
    """After a stop between the two renames of `atomic_folder`: put the old `target` back from aside, or,
    when the new one is already in, remove the old."""
    old = target.with_name(target.name + ".old")
    if not old.exists():
        return
    if target.exists():
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(old, target)


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
