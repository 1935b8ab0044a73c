"""RUN/report.html: every section, images that are real PNGs, the mistakes and flips; the comparison page."""

from __future__ import annotations

import base64
import io
import json
import re
import shutil

import matplotlib.image
import pytest

from tests.conftest import FAST, invoke

SECTIONS = ["config", "curves", "baseline", "per-class", "confusion", "mistakes", "flips"]


def embedded_images(page: str) -> list[bytes]:
    return [base64.b64decode(m) for m in re.findall(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)]


def test_every_run_writes_a_self_contained_report(trained):
    run, output = trained["gemma3"]
    page = (run / "report.html").read_text()
    assert "report: " in output
    for section in SECTIONS:
        assert f'id="{section}"' in page, section
    assert "<script" not in page and "http://" not in page and "https://" not in page  # no JS, no network
    images = embedded_images(page)
    assert len(images) == 5  # curves, per-class bars, confusion matrix, reliability, coverage
    for data in images:
        pixels = matplotlib.image.imread(io.BytesIO(data), format="png")
        assert pixels.shape[0] > 100 and pixels.shape[1] > 100
    assert sorted(p.name for p in (run / "plots").iterdir()) == [
        "confusion.png",
        "coverage.png",
        "curves.png",
        "per_class.png",
        "reliability.png",
    ]

    metrics = json.loads((run / "metrics.json").read_text())
    assert f"test accuracy {metrics['test']['accuracy']:.4f}" in page
    calibration = metrics["calibration"]  # the temperature and the test ECE before and after it
    assert f"Temperature {calibration['temperature']:.3f}" in page
    assert f"{calibration['ece_before']:.4f} raw, {calibration['ece_after']:.4f} with it" in page
    high = metrics["test"]["coverage"][-1]  # the share that keeps a label at the highest floor listed
    cells = f'{high["min_confidence"]:g}</td><td class="num">{high["coverage"]:.3f}</td>'
    assert f'<td class="num">{cells}' in page
    predictions = [json.loads(line) for line in (run / "test_predictions.jsonl").read_text().splitlines()]
    wrong = [p for p in predictions if p["predicted"] != p["gold"]]
    if wrong:
        most = max(wrong, key=lambda p: p["probabilities"][p["predicted"]])
        assert most["text"].replace("&", "&amp;") in page  # the most confident mistake is listed
    else:
        assert "No mistakes." in page
    # a finished run's report says so; results come first, the configuration last and folded
    assert "did not finish" not in page
    order = [
        page.index(f'id="{name}"')
        for name in ("baseline", "per-class", "confusion", "calibration", "abstention", "curves", "config")
    ]
    assert order == sorted(order) and "<details>" in page[order[-1] :]
    evals = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in evals if r["kind"] == "eval"]
    for a, b in zip(steps, steps[1:], strict=False):
        assert f"{a} -&gt; {b}" in page  # one row per pair of consecutive validations


def test_report_command_rebuilds_and_compares(trained, tmp_path):
    runs = []
    for family in ("gemma3", "llama"):
        copy = tmp_path / family
        shutil.copytree(trained[family][0], copy)
        (copy / "report.html").unlink()
        shutil.rmtree(copy / "plots")
        runs.append(copy)
    result = invoke("report", *runs, "--out", tmp_path / "compare.html")
    assert result.exit_code == 0, result.output
    assert all((run / "report.html").is_file() and (run / "plots/curves.png").is_file() for run in runs)
    page = (tmp_path / "compare.html").read_text()
    assert "2 runs compared" in page and all(f">{run.name}</td>" in page for run in runs)
    for column in ("lora_r", "trainable_parameters", "test_macro_f1", "train_examples_per_s"):
        assert f"<th>{column}</th>" in page
    assert len(embedded_images(page)) == 1


def test_report_refuses_an_unfinished_run_unless_told(trained, tmp_path):
    copy = tmp_path / "run"
    shutil.copytree(trained["gemma3"][0], copy)
    (copy / "status.json").write_text(json.dumps({"state": "interrupted"}))
    result = invoke("report", copy)
    assert result.exit_code == 2 and "did not finish (status: interrupted)" in result.output
    result = invoke("report", copy, "--allow-unfinished")
    assert result.exit_code == 0
    assert "did not finish (status: interrupted)" in (copy / "report.html").read_text()


def test_tensorboard_tracking_gets_the_logged_curves(tiny_models, toy_csv, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    args = ["--model", tiny_models["llama"], "--data", toy_csv, "--out", out, "--no-baseline"]
    result = invoke("train", *args, "--track", "tensorboard", *FAST)
    assert result.exit_code == 0, result.output
    events = EventAccumulator(str(next((out / "tracking").iterdir())))
    events.Reload()
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    train = [r for r in log if r["kind"] == "train"]
    scalars = events.Scalars("loss")
    assert [e.step for e in scalars] == [r["step"] for r in train]
    assert [e.value for e in scalars] == pytest.approx([r["loss"] for r in train], rel=1e-6)  # float32
    evals = [r["step"] for r in log if r["kind"] == "eval"]
    assert [e.step for e in events.Scalars("val_macro_f1")] == evals
    assert "test_accuracy" in events.Tags()["scalars"]


def test_tracking_without_its_package_is_refused_clearly(monkeypatch, tiny_models, toy_csv, tmp_path):
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "mlflow" else find_spec(name, *a)
    )
    args = ["--model", tiny_models["llama"], "--data", toy_csv, "--out", tmp_path / "run", "--no-baseline"]
    result = invoke("train", *args, "--track", "mlflow", *FAST)
    assert result.exit_code == 2 and "--track mlflow needs the package: pip install mlflow" in result.output
    assert not (tmp_path / "run").exists()  # refused before the run started


@pytest.fixture(scope="module")
def chinese_run(tiny_models, tmp_path_factory):
    """A finished run whose label names are Chinese (正面/负面)."""
    from tests.conftest import toy_reviews

    root = tmp_path_factory.mktemp("zh")
    data = root / "zh.csv"
    table = toy_reviews(60)
    table["label"] = table["label"].map({"positive": "正面", "negative": "负面"})
    table.to_csv(data, index=False)
    out = root / "run"
    result = invoke(
        "train", "--model", tiny_models["llama"], "--data", data, "--out", out, "--no-baseline", *FAST
    )
    assert result.exit_code == 0, result.output
    return out


@pytest.mark.parametrize("cjk_font", [True, False])
def test_chinese_label_names_get_a_cjk_font_or_a_note(chinese_run, cjk_font, monkeypatch):
    """matplotlib's default font has no CJK glyphs: 正面/负面 were drawn as empty boxes. With a CJK font
    installed (faked: DejaVu Sans's file under the second of `CJK_FONTS`' names) it goes in front of the
    default one; without one (every installed font but those) the page says what to install."""
    import dataclasses

    from loracls.training import fonts, report

    listed = [f for f in fonts.font_manager.fontManager.ttflist if f.name not in fonts.CJK_FONTS]
    dejavu = next(f for f in listed if f.name == "DejaVu Sans")
    if cjk_font:
        listed.append(dataclasses.replace(dejavu, name=fonts.CJK_FONTS[1]))
    monkeypatch.setattr(fonts.font_manager.fontManager, "ttflist", listed)
    monkeypatch.setattr(fonts.font_manager, "findSystemFonts", lambda: [f.fname for f in listed])  # no others
    monkeypatch.setitem(report.plt.rcParams, "font.sans-serif", ["DejaVu Sans", "Arial"])
    monkeypatch.setitem(report.plt.rcParams, "font.family", ["serif"])
    page = report.build_report(chinese_run).read_text()
    sans = report.plt.rcParams["font.sans-serif"]
    if cjk_font:
        assert "No font with Chinese" not in page
        assert sans == [fonts.CJK_FONTS[1], "DejaVu Sans", "Arial"]
        assert report.plt.rcParams["font.family"] == ["sans-serif"]
        assert fonts.use_cjk_font(["正面", "负面"]) is None  # a second report does not add it again
        assert report.plt.rcParams["font.sans-serif"] == sans
    else:
        note = "No font with Chinese/Japanese/Korean glyphs is installed, so label names in the plots show"
        assert note in page and "apt-get install fonts-noto-cjk" in page
        assert sans == ["DejaVu Sans", "Arial"] and report.plt.rcParams["font.family"] == ["serif"]
    assert len(embedded_images(page)) == 5  # the plots are drawn either way
    # labels without CJK characters leave the fonts alone and get no note
    monkeypatch.setitem(report.plt.rcParams, "font.sans-serif", ["DejaVu Sans"])
    assert fonts.use_cjk_font(["positive", "negative"]) is None
    assert report.plt.rcParams["font.sans-serif"] == ["DejaVu Sans"]


def written_run(folder, labels, log, test, baseline=None, full_baseline=None):
    """A finished run folder as `loracls train` leaves it, written directly: the report reads only files."""
    import yaml

    from loracls.config import TrainConfig

    folder.mkdir(parents=True)
    id2label = {str(i): label for i, label in enumerate(labels)}
    files = {
        "status.json": {"state": "finished"},
        "labels.json": {"id2label": id2label, "label2id": {v: int(k) for k, v in id2label.items()}},
        "metrics.json": {"test": test, "best_val": {"step": log[-1]["step"]}, "baseline": baseline},
    }
    if full_baseline is not None:
        files["baseline_metrics.json"] = full_baseline
    for name, value in files.items():
        (folder / name).write_text(json.dumps(value, ensure_ascii=False))
    (folder / "config.yaml").write_text(yaml.safe_dump(TrainConfig().to_dict()))
    (folder / "train_log.jsonl").write_text("".join(json.dumps(r) + "\n" for r in log))
    return folder


def scored(labels, predicted, support):
    """Test figures as `evaluate.score` writes them, for `len(labels)` classes."""
    per_class = {
        label: {"precision": 0.5, "recall": 0.5, "f1-score": 0.5, "support": n}
        for label, n in zip(labels, support, strict=True)
    }
    matrix = [[n if i == j else 0 for j in range(len(labels))] for i, n in enumerate(support)]
    return {
        "accuracy": 0.75,
        "macro_f1": 0.7,
        "weighted_f1": 0.7,
        "per_class": per_class,
        "confusion_matrix": matrix,
        "pred_distribution": dict(zip(labels, predicted, strict=True)),
        "n": sum(support),
    }


ZH_LABELS = ["手机", "电脑", "平板"]
SHORT_LOG = [
    {"kind": "train", "step": 1, "epoch": 1.0, "loss": 1.1, "lr": 0.0},
    {"kind": "eval", "step": 1, "val_accuracy": 0.5, "val_macro_f1": 0.4, "best": True},
]


def glyph_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "missing from font" in str(w.message)]


def test_a_cjk_font_installed_after_matplotlibs_cache_is_found(tmp_path, monkeypatch):
    """After `apt-get install fonts-noto-cjk` (as the report advises) matplotlib still drew boxes: its font
    list is a cache from before the font. With no CJK font in the list, the report adds the font files on
    disk that the list lacks (faked: a file read as `Noto Sans CJK SC`) and writes the list back once."""
    import dataclasses
    import warnings

    from loracls.training import fonts, report

    manager = fonts.font_manager.fontManager
    listed = [f for f in manager.ttflist if f.name not in fonts.CJK_FONTS]  # the stale cache
    dejavu = next(f for f in listed if f.name == "DejaVu Sans")
    on_disk = [dejavu.fname, str(tmp_path / "NotoSansCJK-Regular.ttf")]
    shutil.copy(dejavu.fname, on_disk[1])  # a file matplotlib can open when it draws with the "CJK" font
    added, dumped = [], []

    def addfont(path):
        added.append(path)
        listed.append(dataclasses.replace(dejavu, name=fonts.CJK_FONTS[0], fname=path))

    monkeypatch.setattr(manager, "ttflist", listed)
    monkeypatch.setattr(manager, "addfont", addfont)
    monkeypatch.setattr(fonts.font_manager, "findSystemFonts", lambda: on_disk)
    monkeypatch.setattr(fonts.font_manager, "json_dump", lambda data, path: dumped.append((data, path)))
    monkeypatch.setitem(report.plt.rcParams, "font.sans-serif", ["DejaVu Sans"])
    monkeypatch.setitem(report.plt.rcParams, "font.family", ["sans-serif"])
    run = written_run(tmp_path / "run", ZH_LABELS, SHORT_LOG, scored(ZH_LABELS, [2, 1, 1], [2, 1, 1]))
    with warnings.catch_warnings(record=True):  # the "CJK" font is DejaVu Sans: it has no such glyphs
        page = report.build_report(run).read_text()
    assert added == [on_disk[1]]  # only the file the list lacked
    assert [data for data, _ in dumped] == [manager] and str(dumped[0][1]).endswith(".json")
    assert report.plt.rcParams["font.sans-serif"][0] == fonts.CJK_FONTS[0]
    assert "No font with Chinese" not in page
    with warnings.catch_warnings(record=True):
        assert fonts.use_cjk_font(ZH_LABELS) is None
    assert len(dumped) == 1  # found now: the list is not rebuilt again


def test_without_a_cjk_font_the_glyph_warnings_become_the_one_note(tmp_path, monkeypatch, capsys):
    """Matplotlib warned once per missing glyph and plot (some 40 `UserWarning: Glyph 20070 ... missing
    from font(s) DejaVu Sans` lines at the end of a run); the page's note says it once instead."""
    import warnings

    from loracls.training import fonts, report

    manager = fonts.font_manager.fontManager
    listed = [f for f in manager.ttflist if f.name not in fonts.CJK_FONTS]
    monkeypatch.setattr(manager, "ttflist", listed)
    monkeypatch.setattr(fonts.font_manager, "findSystemFonts", lambda: [f.fname for f in listed])
    monkeypatch.setitem(report.plt.rcParams, "font.sans-serif", ["DejaVu Sans"])
    run = written_run(tmp_path / "run", ZH_LABELS, SHORT_LOG, scored(ZH_LABELS, [2, 1, 1], [2, 1, 1]))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        page = report.build_report(run).read_text()
    assert glyph_warnings(caught) == []
    assert "No font with Chinese/Japanese/Korean glyphs is installed" in page
    terminal = " ".join(capsys.readouterr().err.split())
    assert terminal.count("apt-get install fonts-noto-cjk") == 1
    with warnings.catch_warnings(record=True) as caught:  # the filter was the report's own: matplotlib warns
        warnings.simplefilter("always")
        report.confusion_plot([[1, 0], [0, 1]], ZH_LABELS[:2])
    assert glyph_warnings(caught)


LABELS = ["phone", "laptop", "tablet"]
LONG_LOG = [
    *({"kind": "train", "step": s, "loss": 1.2 - s / 10, "lr": 1e-3 * (1 - s / 6)} for s in (2, 4, 6)),
    *({"kind": "eval", "step": s, "val_accuracy": s / 10, "val_macro_f1": s / 12} for s in (3, 6)),
]


def baseline_figures(accuracy, macro_f1, answers):
    answered = dict(zip(LABELS, answers, strict=True))
    return {"accuracy": accuracy, "macro_f1": macro_f1, "pred_distribution": answered, "n": 99}


def test_the_report_shows_both_baselines_and_what_each_answered(tmp_path):
    """The page showed the uncalibrated baseline only; the calibrated figure and the label counts ("48 of
    99 answered phone") were in the terminal and metrics.json alone."""
    from loracls.training.report import build_report

    full = {
        "headline": "uncalibrated",
        "uncalibrated": baseline_figures(0.4242, 0.2525, [48, 30, 21]),
        "calibrated": baseline_figures(0.5656, 0.5353, [35, 33, 31]),
    }
    summary = {
        **{k: full["uncalibrated"][k] for k in ("accuracy", "macro_f1", "pred_distribution")},
        "headline": "uncalibrated",
        "calibrated_accuracy": 0.5656,
        "uncalibrated_accuracy": 0.4242,
        "shots": 0,
    }
    test = scored(LABELS, [40, 30, 29], [33, 33, 33])
    run = written_run(tmp_path / "run", LABELS, LONG_LOG, test, summary, full)
    page = build_report(run).read_text()
    baseline = page[page.index('id="baseline"') : page.index('id="per-class"')]
    for figure in ("0.4242", "0.2525", "0.5656", "0.5353", "0.7500", "0.3258"):  # 0.75 - 0.4242: the gain
        assert f">{figure}</td>" in baseline, figure
    assert "baseline uncalibrated (0-shot, headline)" in baseline
    for row in (["phone", 33, 48, 35, 40], ["laptop", 33, 30, 33, 30], ["tablet", 33, 21, 31, 29]):
        cells = "".join(f'<td class="{"num" if i else ""}">{v}</td>' for i, v in enumerate(row))
        assert cells in baseline, row  # label, gold, uncalibrated, calibrated, fine-tuned
    assert "48 of 99 answered phone" in baseline

    (run / "baseline_metrics.json").unlink()  # metrics.json alone keeps the calibrated accuracy
    page = build_report(run).read_text()
    assert ">0.5656</td>" in page and ">0.4242</td>" in page and "48 of 99 answered phone" in page


def test_a_run_too_short_for_curves_says_so(tmp_path):
    """One training log and one validation were drawn as single dots (the learning rate: one point at 0 on
    a +-4e-2 axis); the page says the run was too short and lists what it logged."""
    from loracls.training.report import build_report

    run = written_run(tmp_path / "run", LABELS, SHORT_LOG, scored(LABELS, [1, 1, 1], [1, 1, 1]))
    page = build_report(run).read_text()
    curves = page[page.index('id="curves"') : page.index('id="mistakes"')]
    assert "too short for curves" in curves and "<img" not in curves
    assert ">1.1000</td>" in curves and ">0.5000</td>" in curves  # the logged loss, the validation accuracy
    assert not (run / "plots" / "curves.png").exists() and (run / "plots" / "confusion.png").is_file()


def test_curves_mark_their_points_on_axes_that_fit_them():
    from loracls.training.report import curves_figure

    figure = curves_figure(LONG_LOG, best_step=6, peak_lr=1e-3)
    loss, lr, _ = figure.axes
    markers = [line.get_marker() for ax in figure.axes for line in ax.get_lines()[:2]]
    assert markers == ["o"] * 4  # loss, learning rate, validation accuracy and macro-F1
    assert lr.get_ylim()[0] <= 0 < 1e-3 <= lr.get_ylim()[1] <= 1.2e-3  # from 0 to the peak learning rate
    assert loss.get_ylim()[0] == 0
    assert all(ax.get_xlim()[0] == 0 and ax.get_xlim()[1] >= 6 for ax in figure.axes)
    assert all(float(t).is_integer() for t in lr.get_xticks())  # optimizer steps, not 5.5
    assert curves_figure(SHORT_LOG, best_step=1, peak_lr=1e-3) is None
