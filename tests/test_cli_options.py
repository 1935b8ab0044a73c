"""The CLI's shared pieces: help text from config docstrings, wrapping by terminal cells, run-folder checks,
and the exit code and line of a command stopped by a signal."""

from __future__ import annotations

import os
import signal
from dataclasses import fields
from pathlib import Path

import pytest
import typer
from rich.cells import cell_len

from loracls.cli_options import check_run_folder, config_help, default_shown, stops_cleanly, summary, wrap
from loracls.config import TrainConfig
from loracls.console import progress
from loracls.errors import LoraclsError


def test_help_shows_a_keys_first_sentence_and_its_default():
    assert summary("Learning rate, e.g. 1e-3. Higher values diverge.") == "Learning rate, e.g. 1e-3."
    assert summary("No second sentence") == "No second sentence"
    by_name = {f.name: f for f in fields(TrainConfig)}
    assert default_shown(by_name["lr"]) == str(TrainConfig.lr)
    assert default_shown(by_name["multi_label"]) == "no-multi-label"  # the flag in effect
    assert default_shown(by_name["val"]) is None
    assert config_help("lr", whole=False).endswith(f"[default: {TrainConfig.lr}]")


def test_wrapping_counts_terminal_cells_and_breaks_only_at_spaces():
    lines = wrap("情感分析 的 模型 attn-qv --no-multi-label end", 10)
    assert all(cell_len(line) <= 10 or " " not in line for line in lines)
    assert "attn-qv" in lines and "--no-multi-label" in lines  # never broken at a hyphen
    assert " ".join(lines) == "情感分析 的 模型 attn-qv --no-multi-label end"


def test_a_path_without_a_run_is_refused_before_torch_loads(tmp_path):
    with pytest.raises(LoraclsError, match="is not a loracls run folder"):
        check_run_folder(tmp_path)
    (tmp_path / "status.json").write_text("{}")
    check_run_folder(tmp_path)


def test_sigterm_stops_a_command_with_130_and_says_where(capsys):
    @stops_cleanly("nothing was written")
    def command(out: Path) -> None:
        with progress("scoring", 10, "texts") as stage:
            stage.update(3, at="the texts")
            os.kill(os.getpid(), signal.SIGTERM)

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(typer.Exit) as stopped:
        command(Path("x"))
    assert stopped.value.exit_code == 130
    err = capsys.readouterr().err
    assert "interrupted during scoring" in err and "nothing was written" in err
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back
