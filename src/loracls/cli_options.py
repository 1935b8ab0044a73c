"""The CLI's typed options made from the config, its help, and what every command shares: `config_options`
gives a command one `--option` per `TrainConfig` field, its help the field's docstring; `HelpCommand` prints
a command's help as plain text that fits the terminal, the config keys grouped and short; `--version`, the
checks made before the libraries load (`check_run_folder`, `quiet_libraries`) and the error exit (`fail`)."""

from __future__ import annotations

import enum
import functools
import inspect
import re
import signal
import threading
import typing
from dataclasses import Field, fields
from pathlib import Path
from typing import Annotated

import typer
from rich.cells import cell_len
from rich.console import Console
from typer.core import TyperCommand

from loracls.config import TrainConfig, field_docs, field_types
from loracls.console import interrupted_at
from loracls.environment.doctor import package_version
from loracls.errors import Interrupted, LoraclsError

GROUPS = {
    "Model and data": [
        *("model", "data", "val", "test", "text_column", "label_column", "multi_label", "label_separator"),
        *("label_type", "merge_label_case"),
        *("val_fraction", "test_fraction", "dedup", "max_train_examples", "train_fraction"),
        *("max_eval_examples", "max_length", "long_texts", "window_stride"),
    ],
    "LoRA, head and objective": [
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "target_modules",
        "allow_few_targets",
        "head_init",
        *("objective", "response_column"),
    ],
    "Optimisation": [
        *("epochs", "min_steps", "lr", "batch_size", "weight_decay", "warmup_ratio", "warmup_steps"),
        *("schedule", "decay_ratio", "extend_up_to", "max_grad_norm", "class_weights", "seed"),
    ],
    "Validation, checkpoints, logs": [
        *("eval_every", "metric", "temperature_scaling", "early_stopping_patience", "log_every"),
        *("save_every", "keep_checkpoints"),
        *("track", "out"),
    ],
    "Prompt and baseline": [
        *("prompt", "prompt_sample", "prompt_budget", "baseline", "baseline_shots", "verbalizers"),
        *("label_descriptions", "prompt_template", "prompt_instruction"),
        *("label_order", "calibrate", "chat_template"),
    ],
    "Speed and memory": [
        *("micro_batch_size", "length_grouping", "balance_labels", "precision", "gradient_checkpointing"),
        "frozen_base",
        *("attention", "compile", "quantize"),
    ],
    "Safety": ["skip_nonfinite", "smoke_test", "trust_remote_code", "allow_pickle"],
}
"""The config keys by topic, in the order `loracls train --help` and the README list them."""

HELP_ALL = "loracls.help_all"
"""Set in the context's `meta` by `--help-all`: `HelpCommand` then prints every key's whole docstring."""
SENTENCE_END = re.compile(r"(?<!e\.g)(?<!i\.e)\.\s+(?=[A-Z`(])")


def summary(doc: str) -> str:
    """The first sentence of a config key's docstring: what `--help` shows of it. The docstrings are
    written so that it says what the key is and its values; `--help-all` and docs/reference.md show the
    rest."""
    end = SENTENCE_END.search(doc)
    return doc[: end.start() + 1] if end else doc


def default_shown(f: Field) -> str | None:
    """A key's default as `--help` shows it: the value (`0.001`, `attn-qv`), for a true/false key the flag
    in effect (`no-multi-label`, as typer shows a command's own flags), nothing when unset (the key's text
    says what unset means)."""
    if f.default is None:
        return None
    if isinstance(f.default, bool):
        return ("" if f.default else "no-") + f.name.replace("_", "-")
    return str(f.default)


def config_help(name: str, whole: bool) -> str:
    """The help of the option of config key `name`: its first sentence (`whole`: all of it) and default."""
    doc = field_docs()[name]
    default = default_shown(next(f for f in fields(TrainConfig) if f.name == name))
    text = doc if whole else summary(doc)
    return f"{text}  [default: {default}]" if default is not None else text


def show_all_help(ctx: typer.Context, value: bool) -> None:
    """`--help-all`: the help with each config key's whole description."""
    if not value or ctx.resilient_parsing:
        return
    ctx.meta[HELP_ALL] = True
    typer.echo(ctx.get_help())
    raise typer.Exit()


class HelpCommand(TyperCommand):
    """A command whose help is plain text that fits the terminal (the app sets `rich_markup_mode=None`):
    arguments, the command's own options, then any config keys (`config_options`) under the headings of
    `GROUPS`, each with the first sentence of its docstring (all of it with `--help-all`) and its
    default.

    typer's rich panels put a flag pair such as `--gradient-checkpointing / --no-gradient-checkpointing`
    in two columns; at 80 columns that left the text a dozen, and rich cut the names
    (`--gradient-checkpoi…`) to fit."""

    def format_options(self, ctx: typer.Context, formatter) -> None:
        docs, whole = field_docs(), bool(ctx.meta.get(HELP_ALL))
        sections: dict[str, list[tuple[str, str]]] = {"Arguments": [], "Options": []}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is None:
                continue
            if param.param_type_name == "argument":
                sections["Arguments"].append(record)
                continue
            if param.name in docs and param.help == docs[param.name]:  # a config key's option
                record = (record[0], config_help(param.name, whole))
            sections.setdefault(getattr(param, "rich_help_panel", None) or "Options", []).append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    write_definitions(formatter, records)


def write_definitions(formatter, records: list[tuple[str, str]], col_max: int = 30) -> None:
    """click's `write_dl` (names, then their text in a column), but the text wrapped by terminal cells and
    at spaces only: click broke `attn-qv`, `en-tweets` and `--no-multi-label` at their hyphens and counted a
    Chinese character as one column."""
    indent = " " * formatter.current_indent
    first = min(max(cell_len(name) for name, _ in records), col_max) + 2
    for name, text in records:
        lines = wrap(text, max(formatter.width - first - formatter.current_indent, 10))
        if cell_len(name) > first - 2:
            formatter.write(f"{indent}{name}\n")
            name = ""
        for i, line in enumerate(lines or [""]):
            head = name if i == 0 else ""
            formatter.write(f"{indent}{head}{' ' * (first - cell_len(head))}{line}".rstrip() + "\n")


def wrap(text: str, width: int) -> list[str]:
    """`text` in lines of at most `width` cells, broken at spaces (a word longer than that stays whole)."""
    lines, line = [], ""
    for word in text.split(" "):
        joined = f"{line} {word}" if line else word
        if line.strip() and cell_len(joined.rstrip()) > width:
            lines.append(line.rstrip())
            line = word
        else:
            line = joined
    return [*lines, line.rstrip()] if line.strip() else lines


def config_options(command=None, *, only: type | None = None, names: dict[str, list[str]] | None = None):
    """Give `command` one `--option` per config field (of `TrainConfig`, or of `only`), typed as the field,
    its help the field's docstring, grouped by topic (`GROUPS`), and `--help-all`. Register the
    command with `cls=HelpCommand`, which prints them.

    The options default to None, meaning "not given", so a YAML config and `key=value` overrides can fill
    in what the command line left out (the help shows the config's default). `names` gives a field other
    spellings (`--shots` beside `--baseline-shots`).
    """

    def decorate(command):
        docs, types = field_docs(), field_types()
        panel = {key: group for group, keys in GROUPS.items() for key in keys}
        params = []
        by_name = {f.name: f for f in fields(only or TrainConfig)}
        order = [key for keys in GROUPS.values() for key in keys if key in by_name]
        for f in (by_name[key] for key in order):
            kind = next((a for a in typing.get_args(types[f.name]) if a is not type(None)), types[f.name])
            spelled = [f"--{f.name.replace('_', '-')}", *(names or {}).get(f.name, [])]
            if kind is bool:
                spelled = [f"{spelled[0]}/--no-{spelled[0][2:]}", *spelled[1:]]
            option = typer.Option(
                *spelled,
                help=docs[f.name],
                show_default=False,
                rich_help_panel=None if only else panel[f.name],
            )
            annotation = Annotated[kind | None, option]
            params.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
            )
        help_all = typer.Option(
            "--help-all",
            callback=show_all_help,
            is_eager=True,
            help="Show this message with each key's whole text, and exit",
        )
        params.append(
            inspect.Parameter(
                "help_all",
                inspect.Parameter.KEYWORD_ONLY,
                default=False,
                annotation=Annotated[bool, help_all],
            )
        )
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "options"]

        @functools.wraps(command)
        def run(*args, help_all: bool = False, **kwargs):  # --help-all has printed and exited by now
            return command(*args, **kwargs)

        run.__signature__ = signature.replace(parameters=own + params)
        return run

    return decorate(command) if command is not None else decorate


UNFINISHED = typer.Option(help="Accept a run that did not finish: use its best checkpoint so far")
INT8 = typer.Option(
    help="CPU: run the decoder's linear layers in int8 (checked against fp32 on the run's test split first; "
    "refused if it does not match)"
)
LONG_TEXTS = typer.Option(
    help="A text over the run's max_length tokens: cut it, or read it in overlapping windows and average "
    "their probabilities (mean) or take each label's highest (max); default: as the run does (long_texts)",
)


class LongTexts(str, enum.Enum):
    """`--long-texts`' choices (`predict.LONG_TEXTS`)."""

    cut = "cut"
    mean = "mean"
    max = "max"


STRIDE = typer.Option(
    help="Windows (--long-texts mean/max, or a run that reads in windows): tokens between two windows' "
    "starts (default: the run's window_stride, else half a window)",
    min=1,
)
MIN_CONFIDENCE = typer.Option(
    help="Single-label: give no label (abstained) where the top probability is below this; the run's report "
    "shows the coverage and accuracy at each level",
    min=0.0,
    max=1.0,
)


def print_version(asked: bool) -> None:
    """`--version`: loracls's version and the libraries it runs on, without importing them."""
    if not asked:
        return
    names = ("torch", "transformers", "peft", "accelerate")
    libraries = ", ".join(f"{name} {(package_version(name) or 'not installed')}" for name in names)
    typer.echo(f"loracls {(package_version('loracls') or 'not installed')} ({libraries})")
    raise typer.Exit()


def quiet_libraries() -> None:
    """Keep the libraries' own chatter (load reports, map bars) out of loracls's output. A command calls it
    once its arguments are checked: importing transformers takes seconds, and a mistyped path or option
    should be refused before that (`loracls predict runs/nonexistent` spent 8.7 s of CPU to say so)."""
    import warnings

    import datasets
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    datasets.disable_progress_bars()
    # a library's notice about its own internals, not something a user can act on (see pyproject.toml)
    warnings.filterwarnings("ignore", "`is_gradient_checkpointing` is deprecated", FutureWarning)


def check_run_folder(path: Path) -> None:
    """Refuse a path that holds no run, as `RunFolder.check_finished` would once torch has loaded."""
    if not (path / "status.json").is_file():
        raise LoraclsError(f"{path} is not a loracls run folder (no status.json)")


def fail(error: LoraclsError) -> None:
    """Print the message without a traceback; exit 2 (130 for a run stopped by a signal)."""
    Console(stderr=True).print(f"[bold red]error:[/] {error}", highlight=False, soft_wrap=True)
    raise typer.Exit(getattr(error, "exit_code", 2))


def stops_cleanly(kept: str):
    """A command that Ctrl-C (SIGINT) or SIGTERM (a job scheduler, `kill`, `docker stop`) ends with exit code
    130 and a line saying where it stopped (the stage in progress, `interrupted_at`) and what was kept
    (`kept`), instead of click's bare `Aborted!` or a silent death."""

    def decorate(command):
        @functools.wraps(command)
        def run(*args, **kwargs):
            main = threading.current_thread() is threading.main_thread()
            previous = signal.signal(signal.SIGTERM, as_interrupt) if main else None
            try:
                return command(*args, **kwargs)
            except KeyboardInterrupt as e:
                at = interrupted_at(e)
                fail(Interrupted(f"interrupted{f' during {at}' if at else ''}; {kept}"))
            finally:
                if previous is not None:
                    signal.signal(signal.SIGTERM, previous)

        return run

    return decorate


def as_interrupt(number: int, frame) -> None:
    """SIGTERM handled as Ctrl-C is: the stage in progress records where it stopped, outputs are not left."""
    raise KeyboardInterrupt
