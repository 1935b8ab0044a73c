"""The whole pipeline through the command line, on tiny local models."""

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.conftest import FAMILIES, FAST, invoke


@pytest.mark.parametrize("family", FAMILIES)
def test_train_writes_the_whole_run_folder(trained, family):
    run, output = trained[family]
    assert "test accuracy" in output and str(run) in output
    for name in [
        "config.yaml",
        "env.json",
        "labels.json",
        "status.json",
        "targets.json",
        "train_log.jsonl",
        "test_predictions.jsonl",
        "metrics.json",
        "data/val.jsonl",
        "data/test.jsonl",
        "best/adapter_config.json",
        "best/adapter_model.safetensors",
        "best/tokenizer_config.json",
    ]:
        assert (run / name).is_file(), name
    assert json.loads((run / "status.json").read_text())["state"] == "finished"
    cfg = yaml.safe_load((run / "config.yaml").read_text())
    assert cfg["lr"] == 5e-3 and cfg["out"] == str(run)
    env = json.loads((run / "env.json").read_text())
    assert {
        "python",
        "torch",
        "torch_hip",
        "torch_cuda",
        "transformers",
        "peft",
        "accelerate",
        "backend",
        "doctor",
    } <= set(env)
    assert env["doctor"]["backend"] == "cpu" and env["doctor"]["can_train"]

    metrics = json.loads((run / "metrics.json").read_text())
    written = [json.loads(line) for line in (run / "test_predictions.jsonl").read_text().splitlines()]
    right = sum(r["predicted"] == r["gold"] for r in written)
    assert metrics["test"]["n"] == len(written) == 12
    assert metrics["test"]["accuracy"] == pytest.approx(right / 12)
    assert set(metrics["test"]["per_class"]) == {"negative", "positive"}
    assert sum(map(sum, metrics["test"]["confusion_matrix"])) == 12
    assert metrics["train"]["examples_per_s"] > 0 and metrics["train"]["tokens_per_s"] > 0

    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    train_rows = [r for r in log if r["kind"] == "train"]
    eval_steps = [r["step"] for r in log if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == [2, 4, 6, 8, 10, 12]  # 96 examples / 16 = 6 steps/epoch x 2
    assert eval_steps == [4, 8, 12]
    assert all(r["lr"] >= 0 and r["loss"] > 0 and "mem_rss_gb" in r for r in train_rows)
    assert metrics["best_val"]["step"] in eval_steps
    learning = metrics["learning"]  # how it learned, from the same validations, said at the end of the output
    assert (learning["validations"], learning["steps"], learning["best_step"]) == (
        3,
        12,
        metrics["best_val"]["step"],
    )
    assert learning["still_improving"] == (learning["best_step"] == 12)
    weakest = learning["weakest_class"]
    assert weakest["recall"] == min(c["recall"] for c in metrics["test"]["per_class"].values())
    assert f"weakest class on test: {weakest['label']!r}" in output

    val_files = sorted((run / "val_predictions").iterdir())
    assert [f.name for f in val_files] == ["step_000004.jsonl", "step_000008.jsonl", "step_000012.jsonl"]
    rows = [json.loads(line) for line in val_files[-1].read_text().splitlines()]
    val = pd.read_json(run / "data/val.jsonl", lines=True, dtype=False)
    assert [r["id"] for r in rows] == list(val["id"].astype(str))  # every example, in input order
    assert all(abs(sum(r["probabilities"].values()) - 1) < 1e-4 for r in rows)
    assert all(r["predicted"] == max(r["probabilities"], key=r["probabilities"].get) for r in rows)
    assert len((run / "test_predictions.jsonl").read_text().splitlines()) == 12

    targets = json.loads((run / "targets.json").read_text())
    assert len(targets["modules"]) == 4 and all(m.endswith(("q_proj", "v_proj")) for m in targets["modules"])


def test_eval_reproduces_the_test_metrics(trained):
    run, _ = trained["llama"]
    result = invoke("eval", run)
    assert result.exit_code == 0, result.output
    written = json.loads((run / "eval/test/metrics.json").read_text())
    recorded = json.loads((run / "metrics.json").read_text())["test"]
    assert written["accuracy"] == recorded["accuracy"]
    assert written["confusion_matrix"] == recorded["confusion_matrix"]


def test_eval_on_another_file(trained, tmp_path):
    run, _ = trained["qwen3"]
    path = tmp_path / "extra.csv"
    pd.DataFrame(
        {"text": ["good book", "awful plot", "love it"], "label": ["positive", "negative", "positive"]}
    ).to_csv(path, index=False)
    result = invoke("eval", run, "--data", path)
    assert result.exit_code == 0, result.output
    assert json.loads((run / "eval/extra/metrics.json").read_text())["n"] == 3


def test_bad_input_exits_2_before_creating_a_run(tmp_path, toy_csv):
    out = tmp_path / "run"
    result = invoke("train", "--data", tmp_path / "missing.csv", "--out", out)
    assert result.exit_code == 2 and "Data file not found" in result.output
    assert "Traceback" not in result.output and not out.exists()
    result = invoke("train", "--data", toy_csv, "--label-column", "sentiment", "--out", out)
    assert result.exit_code == 2 and "no label column 'sentiment'" in result.output
    result = invoke("train", "lora_rank=4")
    assert result.exit_code == 2 and "Did you mean 'lora_r'" in result.output


def test_a_run_that_fails_is_marked_failed(tmp_path, toy_csv):
    out = tmp_path / "run"
    result = invoke("train", "--model", tmp_path / "nomodel.gguf", "--data", toy_csv, "--out", out)
    assert result.exit_code == 2 and "GGUF file not found" in result.output
    status = json.loads((out / "status.json").read_text())
    assert status["state"] == "failed" and "GGUF file not found" in status["error"]
    assert not (out / "metrics.json").exists()
    assert invoke("eval", out).exit_code == 2


def bad_inputs(tmp: Path, good: Path) -> dict[str, tuple[list, str]]:
    """Each bad input `loracls train` must refuse: (arguments, a phrase of the message)."""
    frame = pd.read_csv(good)

    def csv(name: str, table: pd.DataFrame) -> Path:
        table.to_csv(tmp / name, index=False)
        return tmp / name

    (tmp / "gbk.csv").write_bytes("text,label\n很好,positive\n".encode("gbk"))
    (tmp / "bad.jsonl").write_text('{"text": "a", "label": "x"}\n{"text": "b", "label"\n')
    (tmp / "bad.yaml").write_text("lr: [1e-4\n")
    blank, unlabelled = frame.copy(), frame.copy()
    blank.loc[3, "text"] = "  "
    unlabelled.loc[5, "label"] = None
    neutral = frame.head(10).assign(label="neutral")
    return {
        "missing file": (["--data", tmp / "nope.csv"], "Data file not found"),
        "not utf-8": (["--data", tmp / "gbk.csv"], "is not UTF-8 (tried utf-8"),
        "bad json line": (["--data", tmp / "bad.jsonl"], "line 2 is not valid JSON"),
        "misspelled column": (
            ["--data", good, "--text-column", "txt"],
            "no text column 'txt'. Columns present",
        ),
        "empty text": (
            ["--data", csv("blank.csv", blank)],
            f"empty text in column 'text' in 1 row(s): line 5 of {tmp / 'blank.csv'}",
        ),
        "missing label": (
            ["--data", csv("unlabelled.csv", unlabelled)],
            f"missing label in column 'label' in 1 row(s): line 7 of {tmp / 'unlabelled.csv'} ('')",
        ),
        "label unseen in train": (["--data", good, "--test", csv("neutral.csv", neutral)], "['neutral']"),
        "one class": (["--data", csv("one.csv", frame.assign(label="x"))], "only one class"),
        "rare class": (
            [
                "--data",
                csv(
                    "rare.csv", pd.concat([frame, pd.DataFrame({"text": ["a rare one"], "label": ["rare"]})])
                ),
            ],
            "Cannot make the test split",
        ),
        "duplicates": (
            ["--data", csv("dup.csv", pd.concat([frame, frame.head(3)])), "--dedup", "error"],
            "3 repeated texts",
        ),
        "leakage": (
            ["--data", good, "--test", csv("leak.csv", frame.head(10)), "--dedup", "error"],
            "Leakage between splits",
        ),
        "same file as train and test": (
            ["--data", good, "--test", good],
            "No training examples remain after duplicates and texts shared between splits were removed "
            "(leakage: 108 training texts",
        ),
        "malformed yaml": (["--config", tmp / "bad.yaml"], "is not valid YAML"),
        "unknown key": (["--data", good, "lora_rank=4"], "Did you mean 'lora_r'"),
        "negative lr": (["--data", good, "--lr", "-1"], "lr = -1.0"),
        "rank zero": (["--data", good, "--lora-r", "0"], "lora_r = 0"),
        "dropout one": (["--data", good, "--lora-dropout", "1"], "lora_dropout = 1.0"),
        "bad dedup": (["--data", good, "--dedup", "sometimes"], "dedup = 'sometimes'"),
        "negative warm-up": (["--data", good, "--warmup-steps", "-1"], "warmup_steps = -1"),
        "zero patience": (["--data", good, "--early-stopping-patience", "0"], "early_stopping_patience = 0"),
    }


BAD_CASES = [
    *("missing file", "not utf-8", "bad json line", "misspelled column", "empty text", "missing label"),
    *("label unseen in train", "one class", "rare class", "duplicates", "leakage", "malformed yaml"),
    "same file as train and test",
    *("unknown key", "negative lr", "rank zero", "dropout one", "bad dedup", "negative warm-up"),
    "zero patience",
]


@pytest.mark.parametrize("case", BAD_CASES)
def test_each_bad_input_exits_2_with_its_message(case, tmp_path, toy_csv):
    args, phrase = bad_inputs(tmp_path, toy_csv)[case]
    out = tmp_path / "run"
    # a model that does not exist: refusing anything later than the data checks fails this test at once
    result = invoke("train", *args, "--out", out, "--model", tmp_path / "never-loaded")
    assert result.exit_code == 2, result.output
    assert phrase in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not out.exists()  # refused before a run folder or a model


def test_quantize_4bit_is_refused_on_cpu_before_a_run_starts(tiny_models, toy_csv, tmp_path):
    out = tmp_path / "run"
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", toy_csv, "--out", out, "--quantize", "4bit"
    )
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert "--quantize 4bit needs a GPU" in " ".join(result.output.split()) and not out.exists()


def test_a_qlora_run_is_scored_as_it_was_validated(monkeypatch, tiny_models, toy_csv, tmp_path):
    """QLoRA used to score three models: validation on the 4-bit base with LoRA unmerged, the final test with
    LoRA merged into 4-bit weights (re-quantised) and `eval` merged into an fp32 base. Now the test and
    `eval` score the 4-bit base unmerged, as validation did; an export is the merge into the full-precision
    base and says so. bitsandbytes needs a GPU, so the 4-bit load is faked: what is checked is what loracls
    asks for."""
    from peft.tuners.lora import LoraModel

    import loracls.inference.predict
    import loracls.objective
    import loracls.training.train

    real, asked, merges = loracls.objective.load_classifier, [], []

    def loader(*args, **kwargs):  # records the quantisation asked for, loads full precision
        args = list(args)
        if len(args) > 6:
            asked.append(args[6])
            args[6] = None
        else:
            asked.append(kwargs.pop("quantize", None))
        return real(*args, **kwargs)

    merge = LoraModel.merge_and_unload
    monkeypatch.setattr(LoraModel, "merge_and_unload", lambda self, *a, **k: merges.append(1) or merge(self))
    monkeypatch.setattr(loracls.objective, "load_classifier", loader)  # what training and eval both load
    monkeypatch.setattr(loracls.training.train, "check_quantization", lambda *args: None)
    monkeypatch.setattr(loracls.inference.predict, "four_bit_runs_here", lambda: True)
    out = tmp_path / "qlora"
    args = ["train", "--model", tiny_models["llama"], "--data", toy_csv, "--out", out, "--no-baseline", *FAST]
    result = invoke(*args, "--quantize", "4bit")
    assert result.exit_code == 0, result.output
    assert asked == ["4bit"] and merges == []

    result = invoke("eval", out)
    assert result.exit_code == 0, result.output
    assert asked == ["4bit", "4bit"] and merges == []
    recorded = [json.loads(x) for x in (out / "test_predictions.jsonl").read_text().splitlines()]
    again = [json.loads(x) for x in (out / "eval/test/predictions.jsonl").read_text().splitlines()]
    for a, b in zip(recorded, again, strict=True):
        assert a["probabilities"] == pytest.approx(b["probabilities"], abs=1e-5)

    assert invoke("export", out, "--out", tmp_path / "export").exit_code == 0
    assert asked[-1] is None and merges == [1]  # the full-precision base, merged
    info = json.loads((tmp_path / "export/loracls.json").read_text())
    assert "4-bit base (QLoRA)" in info["merged_into"]


def test_version_names_loracls_and_the_libraries_it_runs_on():
    from importlib.metadata import version

    result = invoke("--version")
    assert result.exit_code == 0, result.output
    assert result.output.startswith(f"loracls {version('loracls')} (torch {version('torch')}, transformers ")


def command_paths() -> list[list[str]]:
    """Every command of the `loracls` app, as the words that run it (`["data", "inspect"]`)."""
    import typer.main

    from loracls.cli import app

    def walk(command, path):
        if hasattr(command, "commands"):
            return [p for name, sub in command.commands.items() for p in walk(sub, [*path, name])]
        return [path]

    return walk(typer.main.get_command(app), [])


def help_at(columns: int, *args: str) -> tuple[str, object]:
    """`loracls ARGS` as a pipe of `columns` columns renders it: (output, the click command)."""
    import typer.main
    from typer.testing import CliRunner

    from loracls.cli import app

    group = typer.main.get_command(app)
    command = group
    for word in args[:-1]:
        command = command.commands[word]
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": str(columns), "TERM": "dumb"})
    assert result.exit_code == 0, result.output
    return result.output, command


@pytest.mark.parametrize("path", command_paths(), ids=" ".join)
def test_help_at_80_columns_names_every_option_whole(path):
    """At 80 columns (a pipe, a plain terminal) `train --help` ran to 652 lines, cut names to
    `--gradient-checkpoi…` and showed defaults as `[default: (auto)]`."""
    from rich.cells import cell_len

    output, command = help_at(80, *path, "--help")
    lines = output.splitlines()
    assert max(cell_len(line) for line in lines) <= 80, max(lines, key=cell_len)
    names = [name for param in command.params for name in (*param.opts, *param.secondary_opts)]
    for name in [n for n in names if n.startswith("--")] + ["--help"]:
        assert re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", output), name
    assert "…" not in output and "[default: (" not in output
    if path == ["train"]:
        assert "[default: 0.001]" in output and "[default: 60]" in output  # min_steps
        assert "[default: no-multi-label]" in output
        assert len(lines) < 4 * len(command.params)  # 652 lines before; the whole texts are behind --help-all


def test_help_all_gives_each_config_key_its_whole_description():
    from rich.cells import cell_len

    from loracls.config import field_docs

    short, _ = help_at(80, "train", "--help")
    full, _ = help_at(80, "train", "--help-all")
    doc = field_docs()["multi_label"]
    assert "Sigmoid outputs" in doc and "Sigmoid outputs" not in short
    assert " ".join(doc.split()) in " ".join(full.split())
    assert "--help-all" in short and len(full.splitlines()) > len(short.splitlines())
    assert max(cell_len(line) for line in full.splitlines()) <= 80  # 正面/负面 take two columns a character


EARLY_REFUSALS = """
import json, sys
from typer.testing import CliRunner
from loracls.cli import app
results = []
for args in json.loads(sys.argv[1]):
    result = CliRunner().invoke(app, args)
    heavy = sorted({"torch", "transformers", "peft"} & set(sys.modules))
    results.append([" ".join(result.output.split()), result.exit_code, heavy])
print(json.dumps(results))
"""


def test_argument_errors_come_before_the_heavy_imports(tmp_path):
    """`loracls predict runs/nonexistent "x"` took 8.7 s of CPU (30-45 s under load) to say the folder
    is no run: the libraries loaded first. Paths, options and config keys are checked before torch."""
    import os
    import subprocess
    import sys

    missing, empty = tmp_path / "nonexistent", tmp_path / "empty"
    empty.mkdir()
    (tmp_path / "sweep.yaml").write_text("grid: {lr: [1e-4]}\nbase: {lr_r: 4}\n")
    cases = {
        "neither a loracls run folder nor a loracls export folder": [
            ["predict", missing, "x"],
            ["predict", empty, "--input", tmp_path / "texts.csv"],
            ["serve", missing],
        ],
        "is not a loracls run folder": [
            ["eval", missing],
            ["export", empty, "--out", tmp_path / "export"],
            ["report", missing],
            ["train", "--resume", missing],
        ],
        "Data file not found": [
            ["train", "--data", tmp_path / "missing.csv"],
            ["baseline", "--data", tmp_path / "missing.csv"],
            ["data", "inspect", tmp_path / "missing.csv"],
        ],
        "Config file not found": [["train", "--config", missing], ["sweep", "--config", missing]],
        "Did you mean 'lora_r'": [["train", "lora_rank=4"]],
        "lr = -1.0": [["train", "--lr", "-1"]],
        "No such option": [["predict", missing, "x", "--no-such-option"], ["train", "--lora-rank", "4"]],
        "--precision must be auto, fp32 or bf16": [["serve", missing, "--precision", "fp64"]],
    }
    runs = [[str(a) for a in args] for group in cases.values() for args in group]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    done = subprocess.run(
        [sys.executable, "-c", EARLY_REFUSALS, json.dumps(runs)], capture_output=True, text=True, env=env
    )
    assert done.returncode == 0, done.stderr
    results = iter(zip(runs, json.loads(done.stdout), strict=True))
    for phrase, group in cases.items():
        for _ in group:
            args, (output, code, heavy) = next(results)
            assert phrase in output and code == 2, (args, output)
            assert heavy == [], (args, heavy)  # checked after each command: none loaded them
