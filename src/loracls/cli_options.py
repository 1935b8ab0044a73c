"""The CLI's typed options made from the config: `config_options` gives a command one `--option` per
`TrainConfig` field, its help the field's docstring."""

from __future__ import annotations

import inspect
import typing
from dataclasses import fields
from typing import Annotated

import typer

from loracls.config import GROUPS, TrainConfig, field_docs, field_types


def config_options(command=None, *, only: type | None = None, names: dict[str, list[str]] | None = None):
    """Give `command` one `--option` per config field (of `TrainConfig`, or of `only`), typed as the field,
    its help from the field's docstring, its default shown, grouped by topic (`config.GROUPS`).

    The options default to None, meaning "not given", so a YAML config and `key=value` overrides can fill
    in what the command line left out. `names` gives a field other spellings (`--shots` beside
    `--baseline-shots`).
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
                show_default="none" if f.default is None else str(f.default),
                rich_help_panel=None if only else panel[f.name],
            )
            annotation = Annotated[kind | None, option]
            params.append(
                inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
            )
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != "options"]
        command.__signature__ = signature.replace(parameters=own + params)
        return command

    return decorate(command) if command is not None else decorate
