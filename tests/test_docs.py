"""The user guide: `mkdocs build --strict` (what `make docs` runs) builds it, and its generated reference
lists every config key and every command, so a new key or command cannot be left out of the docs."""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import typer.main

from loracls.cli import app
from loracls.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},  # Material's banner about its successor
    )


def command_paths(group, prefix=()) -> list[str]:
    """Every leaf command of the click group typer builds, as typed: `train`, `data inspect`, ..."""
    paths = []
    for name, command in group.commands.items():
        if hasattr(command, "commands"):
            paths += command_paths(command, (*prefix, name))
        else:
            paths.append(" ".join((*prefix, name)))
    return paths


def test_guide_builds_strict_and_reference_lists_every_key_and_command(tmp_path):
    result = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert result.returncode == 0, result.stderr

    for page in ("install", "training", "objectives", "long-runs", "serving", "python-api", "contributing"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page
    reference = (tmp_path / "site" / "reference" / "index.html").read_text(encoding="utf-8")
    missing = [f.name for f in dataclasses.fields(TrainConfig) if f'id="key-{f.name}"' not in reference]
    assert not missing, f"config keys missing from the reference: {missing}"
    commands = command_paths(typer.main.get_command(app))
    assert "data inspect" in commands and "train" in commands
    missing = [c for c in commands if f'id="cmd-{c.replace(" ", "-")}"' not in reference]
    assert not missing, f"commands missing from the reference: {missing}"
    # each key's docstring is its description there (one that is easy to find: lora_r's)
    assert "LoRA rank." in reference


def test_strict_build_fails_on_a_broken_link(tmp_path):
    """The strict build is what catches a page that links to a moved page or section: cause one for real."""
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    (tmp_path / "benchmarks").mkdir()
    shutil.copy(ROOT / "benchmarks" / "README.md", tmp_path / "benchmarks" / "README.md")
    shutil.copytree(ROOT / "src", tmp_path / "src", ignore=shutil.ignore_patterns("__pycache__"))
    page = tmp_path / "docs" / "data.md"
    moved = "\nSee [the old section](training.md#no-such-section).\n"
    page.write_text(page.read_text(encoding="utf-8") + moved, encoding="utf-8")
    result = build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert result.returncode != 0
    assert "no-such-section" in result.stderr


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, each space a hyphen."""
    return "".join(c for c in heading.strip().lower() if c.isalnum() or c in "-_ ").replace(" ", "-")


def test_readme_links_reach_files_and_sections():
    """README's relative links (into docs/, benchmarks/) name files that exist and sections those files have,
    as GitHub resolves them: a section moved or renamed in the guide breaks this, not the reader's click."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", readme)
    relative = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") and "#" in link for link in relative)
    for link in relative:
        path, _, anchor = link.partition("#")
        target = ROOT / path
        assert target.is_file(), f"README links to {path}, which does not exist"
        if anchor:
            text = target.read_text(encoding="utf-8")
            headings = re.findall(r"^#+ (.+)$", text, flags=re.MULTILINE)
            assert anchor in {github_anchor(h) for h in headings}, f"README links to {link}: no such section"
