"""The frozen base under 16-bit autocast (`frozen_base`): its decoder linears stored in bf16 train exactly the
numbers fp32 storage trains, and every reader of the run (predict, the export, a shared-base server) rounds
the base's linears as the run trained on them before LoRA merges."""

import json

import numpy as np
import pytest
import torch

from loracls.errors import LoraclsError
from loracls.inference.predict import Classifier, merge_adapter
from loracls.inference.shared_base import ClassifierSet, read_member
from loracls.training.runs import RunFolder
from tests.conftest import FAST, invoke, toy_reviews


def bf16_run(model: str, tmp_path, name: str, *extra: str):
    data = tmp_path / "reviews.csv"
    toy_reviews(80).to_csv(data, index=False)
    out = tmp_path / name
    args = ("--no-baseline", "--head-init", "zero", "--precision", "bf16", *extra)
    result = invoke("train", "--model", model, "--data", data, "--out", out, *FAST, *args)
    assert result.exit_code == 0, result.output
    return out, result.output


def losses(run) -> list[float]:
    log = [json.loads(line) for line in (run / "train_log.jsonl").read_text().splitlines()]
    return [row["loss"] for row in log if "loss" in row]


def scored(run) -> tuple[list[str], np.ndarray]:
    rows = [json.loads(line) for line in (run / "test_predictions.jsonl").read_text().splitlines()]
    return [row["text"] for row in rows], np.array([list(row["probabilities"].values()) for row in rows])


@pytest.fixture(scope="module")
def runs(tiny_models, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("frozen_base")
    stored, output = bf16_run(tiny_models["llama"], tmp, "stored")
    kept, _ = bf16_run(tiny_models["llama"], tmp, "kept", "--frozen-base", "fp32")
    return stored, kept, output


def test_linears_stored_in_bf16_train_the_numbers_fp32_storage_trains(runs):
    stored, kept, output = runs
    assert "linear weights stored in bf16" in output
    assert RunFolder(stored).read_config().frozen_base == "bf16"  # what auto chose, recorded
    assert RunFolder(kept).read_config().frozen_base == "fp32"
    assert len(losses(stored)) > 3
    assert losses(stored) == losses(kept)  # to the last bit: autocast rounds the fp32 weights alike


def test_predict_rounds_the_base_as_the_run_trained_on_it(runs):
    stored, _, _ = runs
    texts, probabilities = scored(stored)
    classifier = Classifier.load(stored)
    classifier.precision = "bf16"  # as the run scored its test split, on any CPU
    np.testing.assert_allclose(classifier.predict_probs(texts), probabilities, atol=1e-6)
    cfg, labels = RunFolder(stored).read_config(), RunFolder(stored).read_labels()
    unrounded, _ = merge_adapter(cfg.model, stored / "best", labels, frozen_base="fp32")
    assert not torch.equal(classifier.model.model.layers[0].mlp.up_proj.weight,
                           unrounded.model.layers[0].mlp.up_proj.weight)  # fmt: skip


def test_an_adapter_export_and_a_shared_base_round_it_too(runs, tmp_path):
    stored, kept, _ = runs
    texts, probabilities = scored(stored)
    result = invoke("export", stored, "--out", tmp_path / "adapter", "--adapter-only")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "adapter/loracls.json").read_text())["frozen_base"] == "bf16"
    exported = Classifier.load(tmp_path / "adapter")
    exported.precision = "bf16"
    np.testing.assert_allclose(exported.predict_probs(texts), probabilities, atol=1e-6)
    exported.precision = "fp32"  # where bf16 autocast would round an unrounded base anyway
    members = [read_member("a", stored), read_member("b", tmp_path / "adapter")]
    shared = ClassifierSet.load(members, torch.device("cpu"), precision="fp32")
    np.testing.assert_allclose(
        shared.classifiers["a"].predict_probs(texts), exported.predict_probs(texts), atol=1e-6
    )
    with pytest.raises(LoraclsError, match="rounded differently"):
        ClassifierSet.load([read_member("a", stored), read_member("k", kept)])


def test_a_run_computing_fp32_on_a_base_rounded_to_bf16_keeps_it_in_fp32(tiny_models, tmp_path):
    """A resume on a device that computes otherwise (or `--frozen-base bf16` asked for in fp32): the base
    rounded as named, held in fp32, and read back the same way."""
    run, output = bf16_run(
        tiny_models["qwen3"], tmp_path, "rounded", "--precision", "fp32", "--frozen-base", "bf16"
    )
    assert "linear weights stored" not in output
    texts, probabilities = scored(run)
    classifier = Classifier.load(run)
    classifier.precision = "fp32"
    np.testing.assert_allclose(classifier.predict_probs(texts), probabilities, atol=1e-6)
    weight = classifier.model.model.layers[0].mlp.up_proj.weight
    assert weight.dtype == torch.float32
