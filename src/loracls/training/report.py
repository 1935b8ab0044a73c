"""`RUN/report.html`: one self-contained page (images embedded, no JavaScript, no network) of what a run did,
with its plots also written as PNG files to `RUN/plots/`; and a page comparing several runs."""

from __future__ import annotations

import base64
import html
import json
import warnings
from pathlib import Path

import yaml

from loracls.console import console
from loracls.files import write_bytes, write_text
from loracls.training.fonts import use_cjk_font
from loracls.training.plots import (
    confusion_plot,
    coverage_plot,
    curves_figure,
    per_class_plot,
    plt,
    png,
    reliability_plot,
)
from loracls.training.runs import RunFolder

STYLE = """
body { font-family: sans-serif; max-width: 1100px; margin: 2em auto; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.text { max-width: 620px; overflow-wrap: anywhere; }
img { max-width: 100%; }
.note { color: #666; }
"""
MAX_ROWS = 25
"""Examples listed per table of mistakes or flips."""


def read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def img(data: bytes, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{base64.b64encode(data).decode()}">'


def table(header: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    """An HTML table of escaped cells; columns in `numeric` are right-aligned."""
    head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(f'<td class="{kind(i, c, numeric)}">{cell(c)}</td>' for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def kind(column: int, value, numeric: set[int]) -> str:
    if column in numeric:
        return "num"
    return "text" if isinstance(value, str) and len(value) > 40 else ""


def cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return html.escape(str(value))


def short_run_section(log: list[dict]) -> list[str]:
    """In place of curves for a run that logged too little to draw them: what it logged."""
    train = sum(r["kind"] == "train" for r in log)
    evals = sum(r["kind"] == "eval" for r in log)
    rows = [
        [
            r["step"],
            r["kind"],
            r.get("loss", ""),
            f"{r['lr']:.3g}" if "lr" in r else "",
            r.get("val_accuracy", ""),
            r.get("val_macro_f1", ""),
        ]
        for r in log
    ]
    header = ["step", "record", "loss", "learning rate", "val accuracy", "val macro-F1"]
    return [
        f'<p class="note">The run logged {train} training step(s) and {evals} validation(s): too short for '
        "curves (more steps, or a smaller log_every and eval_every, draw them).</p>",
        table(header, rows, {0, 2, 3, 4, 5}),
    ]


def mistakes(predictions: list[dict]) -> list[dict]:
    """Wrong predictions, the most confident first (multi-label: the most labels wrong first)."""
    wrong = [p for p in predictions if "gold" in p and p["predicted"] != p["gold"]]
    return sorted(wrong, key=lambda p: -confidence(p))


def confidence(prediction: dict) -> float:
    """The predicted label's probability; for a multi-label prediction, the number of labels it got wrong."""
    if isinstance(prediction["predicted"], list):
        return float(len(set(prediction["predicted"]) ^ set(prediction["gold"])))
    return prediction["probabilities"][str(prediction["predicted"])]  # an int task's labels are ints


def flips(run: RunFolder, best: int | None) -> tuple[list[list], list[list]]:
    """Per pair of consecutive validations: changed, wrong->right, right->wrong; and the examples whose
    prediction differs between the first validation and the best one (step `best`)."""
    files = sorted((run.path / "val_predictions").glob("step_*.jsonl"))
    steps = [(int(f.stem[5:]), {r["id"]: r for r in read_jsonl(f)}) for f in files]
    pairs = []
    for (a, before), (b, after) in zip(steps, steps[1:], strict=False):
        common = before.keys() & after.keys()
        changed = [i for i in common if before[i]["predicted"] != after[i]["predicted"]]
        fixed = sum(after[i]["predicted"] == after[i]["gold"] for i in changed)
        broken = sum(before[i]["predicted"] == before[i]["gold"] for i in changed)
        pairs.append([f"{a} -> {b}", len(changed), fixed, broken])
    examples = []
    by_step = dict(steps)
    if steps and best in by_step and best != steps[0][0]:
        first_step, first = steps[0]
        for i, record in by_step[best].items():
            if i in first and first[i]["predicted"] != record["predicted"]:
                examples.append([record["text"], record["gold"], first[i]["predicted"], record["predicted"]])
        examples.sort(key=lambda row: row[3] != row[1])  # fixed ones first
    return pairs, examples


def calibration_section(calibration: dict | None, plots: dict[str, bytes]) -> list[str]:
    """The temperature fitted on validation, the test ECE before and after it, and the reliability plot."""
    if not calibration:
        return []
    t = calibration["temperature"]
    return [
        '<h2 id="calibration">Calibration (test)</h2>',
        f"<p>Temperature {t:.3f}, fitted on the validation split, divides the logits before the softmax "
        f"({'softens' if t > 1 else 'sharpens'} the probabilities; no label changes). Expected calibration "
        f"error on the test split: {calibration['ece_before']:.4f} raw, {calibration['ece_after']:.4f} with "
        "it. Every reading of the run (eval, predict, serve, the export) applies it.</p>",
        img(plots["reliability"], "reliability diagram"),
    ]


def coverage_section(test: dict | None, plots: dict[str, bytes]) -> list[str]:
    """How many test texts keep a label, and how accurate those are, at each `--min-confidence` level of
    `predict` and `serve` (the calibrated probabilities), so that a user can pick one."""
    if not test or "coverage" not in test:
        return []
    rows = [
        [f"{r['min_confidence']:g}", f"{r['coverage']:.3f}", "" if r["accuracy"] is None else r["accuracy"]]
        for r in test["coverage"]
    ]
    return [
        '<h2 id="abstention">Abstaining below a confidence (test)</h2>',
        "<p>With <code>--min-confidence P</code>, <code>predict</code> and <code>serve</code> give no label "
        "where the top probability is below P. The share of test texts that keep one, and the accuracy on "
        "them:</p>",
        table(["min confidence", "coverage", "accuracy"], rows, {0, 1, 2}),
        img(plots["coverage"], "coverage against accuracy"),
    ]


def build_report(run_dir: str | Path) -> Path:
    """Write `RUN/report.html` and `RUN/plots/*.png` from what the run folder holds; return the page.

    Results first (test metrics, baseline vs fine-tuned, per class, confusion, curves), then what to look at
    (mistakes, how predictions changed), the configuration and environment last, folded.
    """
    run = RunFolder(Path(run_dir))
    metrics = read_json(run.file("metrics.json"))
    labels = run.read_labels()
    best_step = metrics.get("best_val", {}).get("step")
    font_note = use_cjk_font(labels)
    with warnings.catch_warnings():
        if font_note:  # said once, below and on the page, instead of a warning per glyph and plot
            warnings.filterwarnings("ignore", "Glyph .* missing from font", UserWarning)
            console.print(f"[yellow]report: {font_note}[/]", soft_wrap=True)
        plots = write_plots(run, metrics, labels, best_step)
    test = metrics.get("test")
    status = run.status()
    parts = [f"<h1>loracls run {html.escape(run.path.name)}</h1>"]
    if status != "finished":
        parts.append(f'<p class="note">This run did not finish (status: {html.escape(str(status))}).</p>')
    if font_note:
        parts.append(f'<p class="note">{html.escape(font_note)}</p>')
    if test:
        parts.append(
            f"<p><b>test accuracy {test['accuracy']:.4f}, macro-F1 {test['macro_f1']:.4f}</b> on {test['n']} "
            f"examples; best validation step {best_step}.</p>"
        )
    parts += baseline_section(
        metrics.get("baseline"), read_json(run.file("baseline_metrics.json")), test, labels
    )
    parts += prompt_section(read_json(run.file("prompt.json")) if run.file("prompt.json").is_file() else None)
    parts += per_class_sections(test, plots)
    parts += calibration_section(metrics.get("calibration"), plots)
    parts += coverage_section(test, plots)
    parts.append('<h2 id="curves">Training curves</h2>')
    log = read_jsonl(run.file("train_log.jsonl"))
    if "curves" in plots:
        parts.append(img(plots["curves"], "training curves"))
    else:
        parts += short_run_section(log) if log else ["<p>No training log.</p>"]
    parts += mistakes_sections(run, best_step)
    parts += config_section(run)
    out = run.file("report.html")
    write_text(out, page(f"loracls {run.path.name}", parts))
    return out


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def write_plots(run: RunFolder, metrics: dict, labels: list[str], best_step: int | None) -> dict[str, bytes]:
    """The run's PNG plots (curves, per-class bars, confusion matrix, reliability, coverage), also in
    RUN/plots/."""
    log = read_jsonl(run.file("train_log.jsonl"))
    test = metrics.get("test")
    plots: dict[str, bytes] = {}
    peak_lr = yaml.safe_load(run.file("config.yaml").read_text(encoding="utf-8"))["lr"]
    curves = curves_figure(log, best_step, peak_lr) if log else None
    if curves is not None:
        plots["curves"] = png(curves)
    if test:
        plots["per_class"] = per_class_plot(test["per_class"])
    if test and "confusion_matrix" in test:
        plots["confusion"] = confusion_plot(test["confusion_matrix"], labels)
    if metrics.get("calibration"):
        plots["reliability"] = reliability_plot(metrics["calibration"])
    if test and "coverage" in test:
        plots["coverage"] = coverage_plot(test["coverage"])
    (run.path / "plots").mkdir(exist_ok=True)
    (run.path / "plots" / "curves.png").unlink(missing_ok=True)  # from an earlier report, when none now
    for name, data in plots.items():
        write_bytes(run.path / "plots" / f"{name}.png", data)
    return plots


BASELINES = ("uncalibrated", "calibrated")


def baseline_section(summary: dict | None, full: dict, test: dict | None, labels: list[str]) -> list[str]:
    """The prompt baseline uncalibrated and calibrated beside the fine-tuned model on the test split, the
    headline marked; and how often each answered each label, since a baseline that answers one label for
    most texts scores that label's share. `summary` is metrics.json's, `full` baseline_metrics.json."""
    parts = ['<h2 id="baseline">Prompt baseline vs fine-tuned</h2>']
    if not (summary and test):
        return parts + ['<p class="note">No baseline in this run (--no-baseline).</p>']
    scores = baseline_scores(summary, full)
    headline = summary["headline"]
    shots = f"{summary['shots']}-shot"
    names = [f"baseline {v} ({shots}{', headline' if v == headline else ''})" for v in BASELINES]
    rows = [
        [name, *(scores[v].get(key, "") for v in BASELINES), test[key], test[key] - summary[key]]
        for name, key in (("accuracy", "accuracy"), ("macro-F1", "macro_f1"))
    ]
    parts.append(table(["test metric", *names, "fine-tuned", f"gain over {headline}"], rows, {1, 2, 3, 4}))
    answers = {f"{v} baseline": scores[v].get("pred_distribution") for v in BASELINES}
    answers["fine-tuned"] = test.get("pred_distribution")
    answers = {who: counts for who, counts in answers.items() if counts}
    gold = {label: int(figures["support"]) for label, figures in test["per_class"].items()}
    rows = [
        [label, gold.get(label, ""), *(counts.get(label, 0) for counts in answers.values())]
        for label in labels
    ]
    parts.append(f"<p>What each answered on the {test['n']} test texts:</p>")
    parts.append(table(["label", "gold", *answers], rows, set(range(1, len(answers) + 2))))
    most = [
        f"{n} of {test['n']} answered {html.escape(label)} ({who})"
        for who, counts in answers.items()
        for label, n in [max(counts.items(), key=lambda item: item[1])]
    ]
    return parts + [f"<p>Most answered: {'; '.join(most)}.</p>"]


def baseline_scores(summary: dict, full: dict) -> dict[str, dict]:
    """Accuracy, macro-F1 and label counts of each baseline: from baseline_metrics.json, or where a run
    folder lacks it, what metrics.json keeps (both accuracies, the headline's other figures)."""
    if all(v in full for v in BASELINES):
        return {v: full[v] for v in BASELINES}
    scores = {v: {"accuracy": summary[f"{v}_accuracy"]} for v in BASELINES}
    scores[summary["headline"]] |= {k: summary[k] for k in ("macro_f1", "pred_distribution")}
    return scores


def prompt_section(prompt: dict | None) -> list[str]:
    """The chosen prompt, what the classifier reads, and every candidate's zero-shot score on the training
    sample it was chosen on."""
    if prompt is None:
        return []
    words = ", ".join(f"{label}: {word}" for label, word in prompt["verbalizers"].items())
    parts = [
        '<h2 id="prompt">Prompt</h2>',
        f"<p>{html.escape(prompt['name'])}, label words {html.escape(words)}; a text reads as</p>",
        f"<pre>{html.escape(prompt['prefix'] + '{text}' + prompt['suffix'])}</pre>",
    ]
    choice = prompt["choice"]
    if choice["candidates"]:
        rows = [
            [
                c["template"],
                c["verbalizers"],
                c.get("accuracy", "skipped"),
                c.get("macro_f1", ""),
                c.get("n", ""),
            ]
            for c in choice["candidates"]
        ]
        first = choice.get("first_round", 0)
        rounds = (
            f" (every candidate read {first} of them first; the best few read all)"
            if 0 < first < choice["sample"]
            else ""
        )
        parts.append(f"<p>Chosen by zero-shot macro-F1 on {choice['sample']} training examples{rounds}:</p>")
        parts.append(table(["template", "label words", "accuracy", "macro-F1", "examples"], rows, {2, 3}))
    return parts


def per_class_sections(test: dict | None, plots: dict[str, bytes]) -> list[str]:
    """Per-class precision, recall and F1 (table and bars); the confusion matrix (multi-label: 2x2 each)."""
    parts = ['<h2 id="per-class">Per-class precision, recall and F1 (test)</h2>']
    if not test:
        return parts
    rows = [
        [name, r["precision"], r["recall"], r["f1-score"], int(r["support"])]
        for name, r in test["per_class"].items()
    ]
    averages = [k for k in ("micro", "macro", "weighted") if f"{k}_f1" in test]
    rows += [[f"{k} avg", "", "", test[f"{k}_f1"], test["n"]] for k in averages]
    parts.append(table(["class", "precision", "recall", "F1", "support"], rows, {1, 2, 3, 4}))
    parts.append(img(plots["per_class"], "per-class metrics"))
    parts.append('<h2 id="confusion">Confusion matrix (test)</h2>')
    if "confusion" in plots:
        return parts + [img(plots["confusion"], "confusion matrix")]
    rows = [[name, *m[0], *m[1]] for name, m in test["label_confusion"].items()]
    header = ["label", "true negative", "false positive", "false negative", "true positive"]
    return parts + [table(header, rows, {1, 2, 3, 4})]


def mistakes_sections(run: RunFolder, best_step: int | None) -> list[str]:
    """The most confident test mistakes, and how validation predictions changed between checkpoints."""
    parts = ['<h2 id="mistakes">Most confident mistakes (test)</h2>']
    wrong = mistakes(read_jsonl(run.file("test_predictions.jsonl")))
    rows = [[p["text"], p["gold"], p["predicted"], confidence(p)] for p in wrong[:MAX_ROWS]]
    multi = bool(wrong) and isinstance(wrong[0]["predicted"], list)
    header = ["text", "gold", "predicted", "labels wrong" if multi else "confidence"]
    parts.append(table(header, rows, {3}) if rows else "<p>No mistakes.</p>")
    parts.append('<h2 id="flips">How validation predictions changed between checkpoints</h2>')
    pairs, examples = flips(run, best_step)
    header = ["validations", "changed", "wrong to right", "right to wrong"]
    parts.append(table(header, pairs, {1, 2, 3}) if pairs else "<p>Only one validation.</p>")
    if examples:
        parts.append(
            f"<p>{len(examples)} examples predicted differently at the first and the best validation:</p>"
        )
        parts.append(table(["text", "gold", "first", "best"], examples[:MAX_ROWS]))
    return parts


ENVIRONMENT_KEYS = (
    *("backend", "name", "device", "mixed_precision", "torch", "torch_hip", "torch_cuda", "transformers"),
    *("peft", "accelerate", "python", "platform"),
)


def config_section(run: RunFolder) -> list[str]:
    """The resolved config and the environment, folded (`<details>`): the reader comes for the results."""
    config = yaml.safe_load(run.file("config.yaml").read_text(encoding="utf-8"))
    env = read_json(run.file("env.json"))
    return [
        '<h2 id="config">Configuration and environment</h2><details><summary>show</summary>',
        table(["key", "value"], [[k, v] for k, v in config.items()]),
        table(["environment", "value"], [[k, env[k]] for k in ENVIRONMENT_KEYS if env.get(k) is not None]),
        "</details>",
    ]


def page(title: str, parts: list[str]) -> str:
    return (
        f'<!DOCTYPE html><html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n"
    )


def run_summary(run_dir: str | Path) -> dict:
    """One row of a comparison: the settings that vary in sweeps and the figures that decide between runs."""
    run = RunFolder(Path(run_dir))
    config = yaml.safe_load(run.file("config.yaml").read_text(encoding="utf-8"))
    metrics = json.loads(run.file("metrics.json").read_text(encoding="utf-8"))
    params = metrics["trainable_parameters"]
    return {
        "run": run.path.name,
        **{key: config[key] for key in SUMMARY_KEYS},
        "train_examples": metrics["data"]["train"],
        "trainable_parameters": params["trainable"],
        "lora_parameters": params["lora"],
        f"best_val_{config['metric']}": metrics["best_val"][config["metric"]],
        "best_val_step": metrics["best_val"]["step"],
        "test_accuracy": metrics["test"]["accuracy"],
        "test_macro_f1": metrics["test"]["macro_f1"],
        "train_examples_per_s": metrics["train"]["examples_per_s"],
        "wall_s": metrics["train"]["wall_s"],
    }


SUMMARY_KEYS = ("model", "data", "target_modules", "lora_r", "lora_alpha", "lr", "epochs", "max_length")
"""Config keys shown for every run in a comparison."""


def compare_runs(run_dirs: list[Path], out: Path) -> Path:
    """A page with one row per finished run and their validation curves on one plot."""
    rows = [run_summary(r) for r in run_dirs]
    figure, ax = plt.subplots(figsize=(8, 4))
    for run_dir in run_dirs:
        evals = [r for r in read_jsonl(Path(run_dir) / "train_log.jsonl") if r["kind"] == "eval"]
        ax.plot(
            [r["step"] for r in evals],
            [r["val_macro_f1"] for r in evals],
            marker="o",
            label=Path(run_dir).name,
        )
    ax.set(title="validation macro-F1", xlabel="optimizer step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    curves = png(figure)
    header = list(rows[0])
    numeric = {i for i, key in enumerate(header) if isinstance(rows[0][key], int | float)}
    parts = [
        f"<h1>loracls: {len(rows)} runs compared</h1>",
        '<h2 id="runs">Runs</h2>',
        table(header, [[row.get(k, "") for k in header] for row in rows], numeric),
        '<h2 id="curves">Validation curves</h2>',
        img(curves, "validation curves"),
    ]
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text(out, page("loracls comparison", parts))
    return out
