"""The one console every stage prints its progress lines to (stderr; stdout is for results), the progress
of a stage in progress (`progress`), and the tables of metrics the commands print on it.

Under several processes, `train` makes it quiet on all but the main one, so each line appears once.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TaskID, TextColumn, TimeRemainingColumn
from rich.table import Table

console = Console(stderr=True)

FIRST_LINE_S = 5.0
LOG_EVERY_S = 60.0
"""On a console that is not a terminal (a log file, a pipe), where rich draws no bars, a stage that has run
`FIRST_LINE_S` prints a plain line of how far it is, then one every `LOG_EVERY_S`, and one when it ends."""


@dataclass
class Stage:
    """A stage in progress: `done` of `total` `unit` (None: not counted), and where it is in words (`at`:
    "candidate 7 of 20"); `note` is shown beside its bar only (training's latest loss)."""

    what: str
    total: float | None
    unit: str
    done: float = 0.0
    at: str = ""
    note: str = ""
    task: TaskID | None = None
    shown: bool = True
    started: float = field(default_factory=time.monotonic)
    logged: float | None = None
    """When its last plain line was printed (None: none yet)."""
    first: float = field(init=False)
    """`done` at the start (a resumed run's steps before it), which the pace leaves out."""

    def __post_init__(self) -> None:
        self.first = self.done

    def advance(self, amount: float = 1.0) -> None:
        self.update(done=self.done + amount)

    def update(
        self,
        done: float | None = None,
        at: str | None = None,
        note: str | None = None,
        total: float | None = None,
    ) -> None:
        """Move the bar (`total`: the stage turned out longer or shorter); on a console that is not a
        terminal, print how far it is now and then."""
        self.total = self.total if total is None else total
        self.done = self.done if done is None else done
        self.at = self.at if at is None else at
        self.note = self.note if note is None else note
        if _bars is not None and self.task is not None:
            _bars.update(self.task, total=self.total, completed=self.done, at=self.at, note=self.note)
        now = time.monotonic()
        wait = FIRST_LINE_S if self.logged is None else LOG_EVERY_S
        if self.shown and not console.is_terminal and now - (self.logged or self.started) >= wait:
            self.logged = now
            left = self.seconds_left()
            self.line(f", about {duration(left)} left" if left is not None else "")

    def line(self, end: str) -> None:
        console.print(self.position() + end, soft_wrap=True, highlight=False)

    def seconds_left(self) -> float | None:
        """The time left at the pace so far (None before anything is done, or with nothing to count)."""
        if not self.total or self.done <= self.first:
            return None
        pace = (time.monotonic() - self.started) / (self.done - self.first)
        return pace * max(self.total - self.done, 0)

    def position(self) -> str:
        """Where the stage is, in words: `prompt search: candidate 7 of 20, 1,203 of 3,840 prompts`."""
        count = f"{self.done:,.0f} of {self.total:,.0f} {self.unit}".rstrip() if self.total else ""
        parts = [part for part in (self.at, count) if part]
        return f"{self.what}: {', '.join(parts)}" if parts else self.what


_stages: list[Stage] = []
_bars: Progress | None = None


@contextlib.contextmanager
def progress(what: str | None, total: float | None, unit: str = "", done: float = 0) -> Iterator[Stage]:
    """Show `what` with a transient bar (`done` of `total` `unit`, the time left, `Stage.at`) while the block
    runs; a stage inside another (validation inside training) gets its bar under the other's. `what` None:
    show nothing (a server's batches); the `Stage` still counts.

    A console that is not a terminal gets plain lines instead, from a stage that runs long enough to need
    them (`FIRST_LINE_S`). An interrupt (KeyboardInterrupt) inside the block records where it stopped on the
    exception, for its message (`interrupted_at`).
    """
    global _bars
    if what is None:
        yield Stage("", total, unit, done, shown=False)
        return
    if _bars is None and console.is_interactive:  # elsewhere rich draws no bar (and ends with a blank line)
        _bars = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[at]} {task.fields[note]}"),
            console=console,
            transient=True,
        )
        _bars.start()
    stage = Stage(what, total, unit, done)
    if _bars is not None:
        stage.task = _bars.add_task(what, total=total, completed=done, unit=unit, at="", note="")
    _stages.append(stage)
    try:
        yield stage
    except KeyboardInterrupt as e:
        if interrupted_at(e) is None:  # the innermost stage knows best
            e.stopped_at = stage.position()
        raise
    else:
        if stage.logged is not None:  # a log that was told it runs is told it ended
            stage.line(f", done in {duration(time.monotonic() - stage.started)}")
    finally:
        _stages.remove(stage)
        if _bars is not None and _stages:
            _bars.remove_task(stage.task)
        elif _bars is not None:  # its last frame drawn (and cleared: transient), as it stood at the end
            _bars.stop()
            _bars = None


def interrupted_at(error: BaseException) -> str | None:
    """Where an interrupt stopped the innermost stage in progress (`Stage.position`), if it stopped one."""
    return getattr(error, "stopped_at", None)


def duration(seconds: float) -> str:
    """`43 s`, `14 min`, `2 h 5 min`: a time left, as a person reads it."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds // 3600:.0f} h {seconds % 3600 / 60:.0f} min"


def int8_line(check: dict) -> str:
    """How the int8 path compared with fp32 on the run's test split."""
    return (
        f"int8: same prediction as fp32 on {check['agreement']:.1%} of {check['texts']} test texts, accuracy "
        f"{check['accuracy_int8']:.4f} (fp32 {check['accuracy_fp32']:.4f})"
    )


def per_class_table(metrics: dict) -> Table:
    table = Table("class", "precision", "recall", "F1", "support")
    for name, row in metrics["per_class"].items():
        table.add_row(
            name,
            f"{row['precision']:.3f}",
            f"{row['recall']:.3f}",
            f"{row['f1-score']:.3f}",
            str(int(row["support"])),
        )
    return table


def confusion_table(metrics: dict) -> Table:
    names = list(metrics["per_class"])
    table = Table("gold \\ predicted", *names, title="confusion matrix")
    for name, row in zip(names, metrics["confusion_matrix"], strict=True):
        table.add_row(name, *map(str, row))
    return table


def sweep_plan_table(points: list, out) -> Table:
    """`loracls sweep`'s plan: one row per point, a column per varied key."""
    table = Table("run", *points[0].values, title=f"{len(points)} runs into {out}")
    for point in points:
        table.add_row(point.name, *(str(v) for v in point.values.values()))
    return table


def results_table(results, title: str) -> Table:
    """A data frame as a table, floats to 4 places (a sweep's results.csv)."""
    table = Table(*results.columns, title=title)
    for row in results.itertuples(index=False):
        table.add_row(*(f"{v:.4f}" if isinstance(v, float) else str(v) for v in row))
    return table
