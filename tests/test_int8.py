"""The int8 CPU path: `Int8Linear` against float, the fp32 parity gate, and `--int8` through predict, eval,
export and serve."""

import json
import os
import shutil

import pytest
import torch
from torch import nn

from loracls.environment import cpu
from loracls.environment.cpu import SLOW_CPU_OVERRIDE
from loracls.inference import int8
from loracls.inference.predict import Classifier
from tests.conftest import FAMILIES, invoke
from tests.test_serve import server

TEXTS = ["good story", "awful plot, very long and bad", "love"]


def outlier_inputs(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Activations like a decoder's: most channels small, two channels 50x larger."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(seed))
    x[:, [3, 17]] *= 50
    return x


def relative_error(layer: nn.Module, reference: nn.Linear, x: torch.Tensor) -> float:
    with torch.no_grad():
        return float((layer(x) - reference(x)).norm() / reference(x).norm())


def test_int8_linear_matches_float_and_smoothing_is_what_makes_it_close():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = outlier_inputs(200, 64)
    ranges = x.abs().amax(0)
    smoothed = int8.Int8Linear(linear, (ranges**0.5 / linear.weight.abs().amax(0) ** 0.5))
    plain = int8.Int8Linear(linear, torch.ones(64))
    assert relative_error(smoothed, linear, x) < 0.01
    assert relative_error(plain, linear, x) > 2 * relative_error(smoothed, linear, x)
    assert smoothed(x[:1, None]).shape == (1, 1, 48)  # any leading shape, one token


def test_a_texts_result_does_not_depend_on_the_texts_batched_with_it():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    layer = int8.Int8Linear(linear, torch.ones(64))
    x = outlier_inputs(8, 64)
    x[5] *= 1000  # a neighbour with a far larger range
    with torch.no_grad():
        assert torch.equal(layer(x)[0], layer(x[:1])[0])


@pytest.fixture
def run(trained, tmp_path):
    """A copy of the tiny Llama run: the int8 check writes RUN/int8/ into it."""
    return shutil.copytree(trained["llama"][0], tmp_path / "run")


def predictions(*args) -> list[dict]:
    result = invoke("predict", *args, *TEXTS)
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_int8_is_checked_once_against_fp32_and_agrees_through_predict_eval_and_export(run, tmp_path):
    fp32 = predictions(run)
    quantised = predictions(run, "--int8")
    check = json.loads((run / "int8" / "parity.json").read_text())
    assert check["passed"] and check["agreement"] >= int8.MIN_AGREEMENT
    assert [r["label"] for r in quantised] == [r["label"] for r in fp32]
    for a, b in zip(quantised, fp32, strict=True):
        assert max(abs(a["probabilities"][k] - b["probabilities"][k]) for k in a["probabilities"]) < 0.05
    stamp = (run / "int8" / "parity.json").stat().st_mtime_ns
    assert predictions(run, "--int8") == quantised  # the stored calibration: same model, not measured again
    assert (run / "int8" / "parity.json").stat().st_mtime_ns == stamp
    older = check | {"recipe": "an earlier int8 recipe", "passed": False}
    (run / "int8" / "parity.json").write_text(json.dumps(older))
    assert predictions(run, "--int8") == quantised  # a check made another way is measured again
    assert json.loads((run / "int8" / "parity.json").read_text())["recipe"] == int8.RECIPE

    result = invoke("eval", run, "--int8")
    assert result.exit_code == 0, result.output
    metrics = json.loads((run / "eval" / "test-int8" / "metrics.json").read_text())
    assert metrics["accuracy"] == pytest.approx(check["accuracy_int8"])  # the same test texts as the check

    result = invoke("export", run, "--out", tmp_path / "export", "--int8")
    assert result.exit_code == 0, result.output
    assert "int8: same prediction as fp32" in result.output
    info = json.loads((tmp_path / "export" / "loracls.json").read_text())
    assert info["int8"]["agreement"] == check["agreement"]
    from_export = predictions(tmp_path / "export", "--int8")
    for a, b in zip(from_export, quantised, strict=True):
        assert a["label"] == b["label"]
        assert max(abs(a["probabilities"][k] - b["probabilities"][k]) for k in a["probabilities"]) < 1e-5

    result = invoke("export", run, "--out", tmp_path / "plain")
    assert result.exit_code == 0, result.output
    result = invoke("predict", tmp_path / "plain", "--int8", *TEXTS)
    assert result.exit_code != 0 and "export the run again with `loracls export --int8`" in result.output


def test_int8_that_does_not_match_fp32_is_refused(run, monkeypatch):
    monkeypatch.setattr(int8, "MIN_AGREEMENT", 1.01)  # no model can pass
    result = invoke("predict", run, "--int8", *TEXTS)
    assert result.exit_code != 0
    assert "int8 does not match fp32" in result.output and "needs 101%" in result.output


def test_int8_is_refused_before_loading_on_a_cpu_without_int8_instructions(run, tmp_path, monkeypatch):
    monkeypatch.delenv(SLOW_CPU_OVERRIDE)
    monkeypatch.setattr(cpu, "cpu_flags", lambda: {"avx2", "fma", "avx512f"})  # no VNNI, no AMX
    for command in (
        ["predict", run, "--int8", *TEXTS],
        ["eval", run, "--int8"],
        ["export", run, "--out", tmp_path / "export", "--int8"],
        ["serve", run, "--int8"],
    ):
        result = invoke(*command)
        assert result.exit_code == 2, (command, result.output)
        assert "this CPU lacks" in result.output and SLOW_CPU_OVERRIDE in result.output
    assert not (run / "int8").exists() and not (tmp_path / "export").exists()
    monkeypatch.setenv(SLOW_CPU_OVERRIDE, "1")
    assert invoke("predict", run, "--int8", *TEXTS).exit_code == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_quantises_and_stays_close_to_fp32(trained, family):
    classifier = Classifier.load(trained[family][0])
    classifier.precision = "fp32"
    reference = classifier.predict_probs(TEXTS)
    ranges = int8.input_ranges(classifier.model, lambda: classifier.predict_probs(TEXTS))
    int8.quantize(classifier.model, ranges)
    replaced = [m for m in classifier.model.modules() if isinstance(m, int8.Int8Linear)]
    assert len(replaced) == len(ranges) > 0
    assert abs(classifier.predict_probs(TEXTS) - reference).max() < 0.05


def test_serve_int8_answers_as_predict_int8_and_says_how_it_compared(run):
    import httpx

    expected = predictions(run, "--int8")
    with server(run, "--int8") as (url, _):
        info = httpx.get(f"{url}/info").json()
        data = httpx.post(f"{url}/classify", json={"input": TEXTS}).json()["data"]
    assert info["int8"]["passed"] and info["int8"]["texts"] > 0
    assert [d["label"] for d in data] == [r["label"] for r in expected]
    for d, r in zip(data, expected, strict=True):
        probs = dict(zip(info["labels"], d["probs"], strict=True))
        assert max(abs(p - r["probabilities"][k]) for k, p in probs.items()) < 1e-4


def test_a_stored_int8_check_is_measured_again_when_what_it_depends_on_changes(run, tmp_path, monkeypatch):
    """RUN/int8/ holds for one base model's weights, torch build, recipe and adapter: a re-converted base
    model (its weight files rewritten) or another torch measures again instead of reusing a "passed"."""
    import yaml

    base = shutil.copytree(yaml.safe_load((run / "config.yaml").read_text())["model"], tmp_path / "base")
    config = yaml.safe_load((run / "config.yaml").read_text()) | {"model": str(base)}
    (run / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    first = predictions(run, "--int8")

    def measured_again() -> bool:
        stamp = (run / "int8" / "parity.json").stat().st_mtime_ns
        assert predictions(run, "--int8") == first
        return (run / "int8" / "parity.json").stat().st_mtime_ns != stamp

    assert not measured_again()
    weights = base / "model.safetensors"
    weights.write_bytes(weights.read_bytes())  # converted again: the same bytes, a new file
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert measured_again()
    assert not measured_again()
    monkeypatch.setattr(torch, "__version__", torch.__version__ + ".post1")
    assert measured_again()
    check = json.loads((run / "int8" / "parity.json").read_text())
    assert check["torch"] == torch.__version__ and check["base_model"]["files"]["model.safetensors"]
