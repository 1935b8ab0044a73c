"""`loracls.console.progress`, the progress every long stage shows: a bar on a terminal, plain lines in a
log, and where an interrupt stopped it."""

import re

import pytest

from loracls import console as module
from loracls.console import duration, interrupted_at, progress


def test_a_stage_draws_its_bar_on_a_terminal(terminal):
    with progress("scoring", 4, "texts") as stage:
        stage.update(at="part one")
        stage.advance(3)
    shown = terminal.getvalue()
    assert re.search(r"scoring .*3/4 texts .*part one", shown), shown
    assert module._bars is None  # the last stage to end takes the bar down


def test_a_stage_inside_another_stacks_its_bar_and_leaves_the_outer_one(terminal):
    with progress("train", 10, "steps") as outer:
        with progress("validation", 8, "examples") as inner:
            inner.advance(8)
            assert [s.what for s in module._stages] == ["train", "validation"]
        outer.advance(10)
        assert [s.what for s in module._stages] == ["train"]
    assert "10/10 steps" in terminal.getvalue()


def test_a_log_gets_plain_lines_from_a_long_stage_and_none_from_a_quick_one(log_file, monkeypatch):
    with progress("validation", 40, "examples") as stage:
        stage.advance(10)
        stage.update(done=40, at="last batch")
    lines = log_file.getvalue().splitlines()
    assert re.fullmatch(r"validation: 10 of 40 examples, about \d+ s left", lines[0]), lines
    assert re.fullmatch(r"validation: last batch, 40 of 40 examples, about 0 s left", lines[1]), lines
    assert re.fullmatch(r"validation: last batch, 40 of 40 examples, done in \d+ s", lines[2]), lines
    assert len(lines) == 3

    monkeypatch.setattr(module, "FIRST_LINE_S", 5.0)  # the default: a stage done in less prints nothing
    log_file.truncate(0)
    log_file.seek(0)
    with progress("validation", 40, "examples") as stage:
        stage.advance(40)
    assert log_file.getvalue() == ""


def test_an_interrupt_records_where_the_innermost_stage_stopped():
    outer = progress("train", 48, "steps", done=6)
    with pytest.raises(KeyboardInterrupt) as stopped, outer, progress("validation", 40, "examples") as inner:
        inner.update(done=12, at="batch 2")
        raise KeyboardInterrupt
    assert interrupted_at(stopped.value) == "validation: batch 2, 12 of 40 examples"
    assert not module._stages and module._bars is None
    assert interrupted_at(KeyboardInterrupt()) is None


def test_a_stage_without_a_name_counts_and_shows_nothing(terminal):
    with progress(None, 3, "texts") as stage:
        stage.advance(3)
        assert stage.done == 3 and module._bars is None
    assert terminal.getvalue() == ""


def test_durations_read_as_a_person_says_them():
    assert [duration(s) for s in (4.2, 89, 90, 14 * 60, 2 * 3600 + 5 * 60)] == [
        "4 s",
        "89 s",
        "2 min",
        "14 min",
        "2 h 5 min",
    ]
