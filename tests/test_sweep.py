"""Sweeps: grid expansion, checks before any run, results table and plots, and resuming a sweep."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

from loracls.errors import LoraclsError
from loracls.training.sweep import load_sweep
from tests.conftest import invoke


def sweep_file(tmp_path, **spec) -> str:
    path = tmp_path / "sweep.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path


def test_grid_crossed_with_runs_in_order(tmp_path):
    path = sweep_file(
        tmp_path,
        out=str(tmp_path / "s"),
        base={"lora_alpha": 8, "epochs": 1},
        grid={"lora_r": [2, 4], "target_modules": ["attn-qv", "attn"]},
        runs=[{"lr": 1e-3}, {"lr": 5e-3, "lora_alpha": 16}],
    )
    out, points = load_sweep(path)
    assert out == tmp_path / "s" and len(points) == 8
    assert points[0].name == "00_lr=0.001,lora_r=2,target_modules=attn-qv"
    assert points[3].values == {"lr": 1e-3, "lora_alpha": 8, "lora_r": 4, "target_modules": "attn"}
    assert points[7].config.lora_alpha == 16 and points[7].config.lr == 5e-3 and points[7].config.lora_r == 4
    assert all(p.config.epochs == 1 and p.config.baseline is False for p in points)
    assert points[5].config.out == str(tmp_path / "s/runs" / points[5].name)


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"grid": {"lora_rank": [8]}}, "Unknown config key 'lora_rank'.*Did you mean 'lora_r'"),
        ({"grid": {"lr": [1e-4, -1]}}, "lr = -1.0"),
        ({"grid": {"lora_r": 8}}, "non-empty lists"),
        ({"gird": {"lora_r": [8]}}, r"unknown sweep key\(s\) \['gird'\]"),
    ],
)
def test_bad_sweep_files_are_refused_before_any_run(tmp_path, spec, message):
    with pytest.raises(LoraclsError, match=message):
        load_sweep(sweep_file(tmp_path, out=str(tmp_path / "s"), **spec))
    assert not (tmp_path / "s").exists()


def test_sweep_runs_writes_results_and_resumes(tmp_path, tiny_models, toy_csv):
    out = tmp_path / "sweep"
    base = {
        **{"model": str(tiny_models["llama"]), "data": str(toy_csv), "epochs": 1, "batch_size": 8},
        **{"eval_every": 4, "lr": 5e-3, "max_length": 64},
    }
    path = sweep_file(
        tmp_path, out=str(out), base=base, grid={"lora_r": [2, 4], "train_fraction": [0.5, 1.0]}
    )
    result = invoke("sweep", "--config", path)
    assert result.exit_code == 0, result.output
    results = pd.read_csv(out / "results.csv")
    assert list(results.columns) == [
        *("run", "lora_r", "train_fraction", "train_examples", "trainable_parameters"),
        *("best_val_macro_f1", "best_val_step", "test_accuracy", "test_macro_f1", "wall_s"),
        "train_examples_per_s",
    ]
    assert len(results) == 4 and sorted(set(results["train_examples"])) == [48, 96]
    by_rank = results.groupby("lora_r")["trainable_parameters"].first()
    assert by_rank[4] > by_rank[2]  # rank 4 trains more parameters
    assert (out / "results.md").read_text().startswith("| run | lora_r | train_fraction |")
    for name in ("metric_vs_params.png", "learning_curve.png", "compare.html", "sweep.yaml"):
        assert (out / name).is_file(), name

    # run again: every point is finished and skipped, the results are the same
    stamp = (out / "runs" / results["run"][0] / "metrics.json").stat().st_mtime_ns
    again = invoke("sweep", "--config", path)
    assert again.exit_code == 0 and again.output.count("(finished)") == 4
    assert (out / "runs" / results["run"][0] / "metrics.json").stat().st_mtime_ns == stamp
    # a point that was interrupted resumes from its checkpoint instead of starting over
    stopped = out / "runs" / results["run"][1]
    (stopped / "status.json").write_text(json.dumps({"state": "interrupted"}))
    (stopped / "metrics.json").unlink()
    again = invoke("sweep", "--config", path)
    assert again.exit_code == 0 and "(interrupted)" in again.output and "Resuming" in again.output
    assert json.loads((stopped / "status.json").read_text())["state"] == "finished"
    pd.testing.assert_frame_equal(
        pd.read_csv(out / "results.csv").drop(columns=["wall_s", "train_examples_per_s"]),
        results.drop(columns=["wall_s", "train_examples_per_s"]),
    )
