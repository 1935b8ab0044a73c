"""`loracls sweep`: one training run per point of a grid (or list) of config values, resumable, with a results
table and plots.

A sweep file:

    out: sweeps/rank-targets          # the sweep folder
    base:                             # config keys every run shares (`config: FILE` reads a config first)
      config: configs/demo.yaml
      max_train_examples: 400
    grid:                             # every combination, in this order
      lora_r: [8, 16, 32]
      target_modules: [attn-qv, attn, all-linear]
    runs:                             # and/or a list of points (each crossed with the grid)
      - {lr: 1e-4}

SWEEP/runs/NN_key=value,.../   one run folder per point (finished points are skipped; unfinished ones resume)
SWEEP/results.csv, results.md  one row per run: the varied keys, parameters, metrics, time, throughput
SWEEP/*.png, compare.html      metric vs trainable parameters, metric vs training-data size, all curves
"""

from __future__ import annotations

import itertools
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from loracls.config import TrainConfig, check_known_keys, read_yaml_config
from loracls.console import console
from loracls.errors import LoraclsError
from loracls.files import write_text
from loracls.training import checkpoints
from loracls.training.report import compare_runs, plt, png, run_summary
from loracls.training.runs import RunFolder
from loracls.training.train import resume, train

SWEEP_KEYS = ("out", "base", "grid", "runs")
SIZE_KEYS = ("max_train_examples", "train_fraction")
"""Keys that set the training-data size: the x-axis of the learning curve."""
CAPACITY_KEYS = ("lora_r", "lora_alpha")
"""Keys that change the trainable parameters within one setting: the x-axis of metric vs parameters."""


@dataclass
class Point:
    name: str
    """Folder name under SWEEP/runs: its index and the values that vary."""
    values: dict[str, Any]
    """The varied keys and this point's values."""
    config: TrainConfig


def load_sweep(path: Path) -> tuple[Path, list[Point]]:
    """Read and expand a sweep file; every point's config is checked before any run starts."""
    spec = read_yaml_config(path)
    unknown = sorted(set(spec) - set(SWEEP_KEYS))
    if unknown:
        raise LoraclsError(
            f"{path}: unknown sweep key(s) {unknown}; a sweep file has {', '.join(SWEEP_KEYS)}."
        )
    base = dict(spec.get("base") or {})
    if "config" in base:
        base = {**read_yaml_config(Path(base.pop("config"))), **base}
    base.setdefault("baseline", False)  # one prompt baseline is enough: `loracls baseline`, or set it here
    grid = spec.get("grid") or {}
    runs = spec.get("runs") or [{}]
    if not isinstance(grid, dict) or not all(isinstance(v, list) and v for v in grid.values()):
        raise LoraclsError(f"{path}: `grid` maps config keys to non-empty lists of values")
    if not isinstance(runs, list) or not all(isinstance(r, dict) for r in runs):
        raise LoraclsError(f"{path}: `runs` is a list of mappings of config keys to values")
    for source, keys in (("base", base), ("grid", grid), *(("runs", r) for r in runs)):
        check_known_keys(keys, source=f"{path} ({source})")
    combos = [dict(zip(grid, values, strict=True)) for values in itertools.product(*grid.values())]
    raw = [{**run, **combo} for run in runs for combo in combos]
    varied = list(dict.fromkeys(k for point in raw for k in point))
    out = Path(spec.get("out") or f"sweeps/{path.stem}")
    points = []
    for i, values in enumerate(raw):
        label = ",".join(f"{k}={values[k]}" for k in varied if k in values)
        name = f"{i:02d}_" + re.sub(r"[^A-Za-z0-9=.,_-]+", "-", label)[:80]
        config = TrainConfig.load(None, {**base, **values, "out": str(out / "runs" / name)})
        points.append(Point(name, {k: values.get(k, base.get(k)) for k in varied}, config))
    if not points:
        raise LoraclsError(f"{path}: the sweep has no points")
    return out, points


def run_sweep(path: Path) -> tuple[Path, pd.DataFrame, list[str]]:
    """Run every point not yet finished; returns the sweep folder, the results and the failed points."""
    out, points = load_sweep(path)
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(path, out / "sweep.yaml")
    failed = []
    for k, point in enumerate(points, 1):
        run = RunFolder(Path(point.config.out))
        state = run.status()
        console.rule(f"[bold]{k}/{len(points)} {point.name}[/] ({state or 'new'})")
        try:
            if state == "finished":
                continue
            if state is not None and checkpoints.latest(run.path):
                resume(run.path)
            else:
                shutil.rmtree(run.path, ignore_errors=True)  # nothing worth keeping: no checkpoint
                train(point.config)
        except LoraclsError as e:
            console.print(f"[bold red]{point.name} failed:[/] {e}")
            failed.append(point.name)
        write_results(out, points)
    return out, write_results(out, points), failed


def write_results(out: Path, points: list[Point]) -> pd.DataFrame:
    """results.csv/.md, the plots and compare.html from the finished points."""
    rows = []
    for point in points:
        run = RunFolder(Path(point.config.out))
        if run.status() != "finished":
            continue
        summary = run_summary(run.path)
        rows.append(
            {
                "run": point.name,
                **point.values,
                "train_examples": summary["train_examples"],
                "trainable_parameters": summary["trainable_parameters"],
                **{k: v for k, v in summary.items() if k.startswith(("best_val", "test_"))},
                "wall_s": round(summary["wall_s"], 1),
                "train_examples_per_s": round(summary["train_examples_per_s"], 2),
            }
        )
    table = pd.DataFrame(rows)
    if table.empty:
        return table
    table.to_csv(out / "results.csv", index=False)
    write_text(out / "results.md", markdown(table))
    varied = list(points[0].values)
    others = [k for k in varied if k not in CAPACITY_KEYS]
    line_plot(table, "trainable_parameters", others, out / "metric_vs_params.png")
    if any(k in varied for k in SIZE_KEYS):
        others = [k for k in varied if k not in SIZE_KEYS]
        line_plot(table, "train_examples", others, out / "learning_curve.png")
    finished = [Path(p.config.out) for p in points if p.name in set(table["run"])]
    compare_runs(finished, out / "compare.html")
    return table


def line_plot(table: pd.DataFrame, x: str, group_by: list[str], path: Path, y: str = "test_macro_f1") -> None:
    """`y` against `x`, one line per combination of the `group_by` keys."""
    figure, ax = plt.subplots(figsize=(7, 4))
    groups = table.groupby(group_by, sort=False, dropna=False) if group_by else [((), table)]
    for key, rows in groups:
        rows = rows.sort_values(x)
        key = key if isinstance(key, tuple) else (key,)
        label = ", ".join(f"{k}={v}" for k, v in zip(group_by, key, strict=True)) or "all runs"
        ax.plot(rows[x], rows[y], marker="o", label=label)
    if x == "trainable_parameters":
        ax.set_xscale("log")
    ax.set(xlabel=x.replace("_", " "), ylabel=y.replace("_", " "), title=f"{y} vs {x}".replace("_", " "))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path.write_bytes(png(figure))


def markdown(table: pd.DataFrame) -> str:
    """A Markdown table (pandas' own needs the `tabulate` package)."""

    def fmt(value) -> str:
        return f"{value:.4f}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in table.itertuples(index=False)]
    return "\n".join(lines) + "\n"
