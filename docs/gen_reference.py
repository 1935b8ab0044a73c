"""MkDocs hook: the pages that are built from the code and from the benchmarks, not kept in docs/.

- `reference.md`: every `TrainConfig` key (type, default, the docstring under the field in
  src/loracls/config.py, grouped as `loracls train --help` groups them) and every command of the `loracls`
  CLI with its arguments and options (read from the typer app in src/loracls/cli.py). docs/reference.md is
  a stub (what GitHub shows); the built page replaces its text.
- `benchmarks.md`: benchmarks/README.md, so that the guide can link to the measured figures. The pages link
  to `../benchmarks/README.md` (which works on GitHub); the links are pointed at this page when built.

The code is imported from this checkout's src/, so the pages describe the code beside them.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from mkdocs.structure.files import File

BENCHMARKS_LINK = "../benchmarks/README.md"


def on_files(files, config):
    root = Path(config.config_file_path).resolve().parent
    sys.path.insert(0, str(root / "src"))
    benchmarks = (root / "benchmarks" / "README.md").read_text(encoding="utf-8")
    files.append(File.generated(config, "benchmarks.md", content=benchmarks))
    return files


def on_page_markdown(markdown, page, config, files):
    if page.file.src_uri == "reference.md":
        return reference_page()
    return markdown.replace(f"]({BENCHMARKS_LINK}", "](benchmarks.md")


def default_text(value) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def config_section() -> list[str]:
    from loracls.cli_options import GROUPS
    from loracls.config import TrainConfig, field_docs

    docs = field_docs()
    by_name = {f.name: f for f in dataclasses.fields(TrainConfig)}
    grouped = {group: [key for key in keys if key in by_name] for group, keys in GROUPS.items()}
    listed = {key for keys in grouped.values() for key in keys}
    others = [name for name in by_name if name not in listed]
    if others:
        grouped["Other"] = others
    lines = [
        "## Configuration keys",
        "",
        "Each key is a YAML key of a `--config` file, a `key=value` override and a `loracls train` option "
        "(`lora_r` is `--lora-r`; a true/false key `flag` is `--flag` / `--no-flag`). `RUN/config.yaml` "
        "stores the resolved values of a run.",
        "",
    ]
    for group, keys in grouped.items():
        lines += [f"### {group}", ""]
        for name in keys:
            f = by_name[name]
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            option = "--" + name.replace("_", "-")
            about = f"`{option}`; `{f.type}`; default {default_text(default)}"
            lines.append(f'- <a id="key-{name}"></a>**`{name}`** ({about}): {docs.get(name, "")}')
        lines.append("")
    return lines


def type_name(param) -> str:
    """The option's value type: click's `type.name`, or the annotation typer keeps (typer 0.2x bundles its
    own click and has no `type` on a parameter)."""
    if getattr(param, "type", None) is not None:
        return param.type.name
    annotation = getattr(getattr(param, "type_descriptor", None), "annotation", None)
    return getattr(annotation, "__name__", None) or str(annotation).replace("typing.", "")


def param_line(param, config_keys: set[str]) -> str:
    from loracls.config import field_docs

    docs = field_docs()
    if param.param_type_name == "argument":
        name = param.name.upper() + (" ..." if param.nargs == -1 else "")
        required = "required" if param.required else "optional"
        return f"- `{name}` (argument, {required}): {getattr(param, 'help', None) or ''}"
    flags = " / ".join(f"`{opt}`" for opt in [*param.opts, *param.secondary_opts])
    kind = "flag" if param.is_flag else f"`{type_name(param)}`"
    extra = ""
    if param.name in config_keys and param.help == docs.get(param.name):
        extra = f"; the config key [`{param.name}`](#key-{param.name})"
    elif param.default is not None and not callable(param.default):
        extra = f"; default {default_text(param.default)}"
    return f"- {flags} ({kind}{extra}): {param.help or ''}"


def command_section(command, path: list[str], config_keys: set[str]) -> list[str]:
    if hasattr(command, "commands"):  # a group (typer's own click, or click)
        lines = []
        for name, sub in command.commands.items():
            lines += command_section(sub, [*path, name], config_keys)
        return lines
    anchor = "cmd-" + "-".join(path)
    lines = [f"### `loracls {' '.join(path)}` {{#{anchor}}}", "", (command.help or "").strip(), ""]
    own, keys = [], []
    for param in command.params:
        if getattr(param, "rich_help_panel", None) and param.name in config_keys:
            keys.append(param.name)  # one option per config key, described above
        else:
            own.append(param)
    lines += [param_line(param, config_keys) for param in own]
    if keys:
        links = ", ".join(f"[`--{key.replace('_', '-')}`](#key-{key})" for key in keys)
        lines += ["", f"And one option per [configuration key](#configuration-keys): {links}."]
    return [*lines, ""]


def reference_page() -> str:
    import typer.main

    from loracls.cli import app
    from loracls.config import TrainConfig

    config_keys = {f.name for f in dataclasses.fields(TrainConfig)}
    lines = [
        "# Reference",
        "",
        "Generated from the code when the guide is built: the configuration keys from the docstrings under "
        "`TrainConfig`'s fields (`src/loracls/config.py`), the commands from the CLI (`src/loracls/cli.py`). "
        "`loracls COMMAND --help` prints the same.",
        "",
        *config_section(),
        "## Commands",
        "",
    ]
    lines += command_section(typer.main.get_command(app), [], config_keys)
    return "\n".join(lines) + "\n"
