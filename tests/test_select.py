"""`loracls select` (`inference/select.py`): the texts to label next are the unsure ones, spread over kinds of
text, and come out in the training file's layout."""

import numpy as np
import pandas as pd

from loracls.inference.predict import Classifier
from loracls.inference.select import CANDIDATES, choose, uncertainty
from loracls.training.runs import RunFolder
from tests.conftest import invoke, toy_reviews


def test_uncertainty_is_one_minus_the_margin_or_the_distance_to_a_threshold():
    probs = np.array([[0.9, 0.1, 0.0], [0.4, 0.35, 0.25], [0.5, 0.5, 0.0]])
    assert np.allclose(uncertainty(probs), [0.2, 0.95, 1.0])
    multi = np.array([[0.9, 0.05], [0.45, 0.0], [0.7, 0.9]])
    assert np.allclose(uncertainty(multi, [0.5, 0.3]), [0.5, 0.9, 0.6])  # the label nearest its threshold


def test_the_chosen_spread_over_clusters_where_the_least_sure_alone_would_not():
    rng = np.random.default_rng(0)
    near, far = rng.normal([5, 0], 0.1, (20, 2)), rng.normal([0, 5], 0.1, (20, 2))
    read = np.vstack([near, far])
    unsure = np.r_[np.full(20, 0.9) + rng.uniform(0, 0.05, 20), np.full(20, 0.5)]
    top = np.argsort(-unsure)[:2]
    assert (top < 20).all()  # the two least sure are both of the first kind
    chosen = choose(unsure, read, 2, seed=0)
    assert sorted(chosen < 20) == [False, True]  # one of each kind
    assert unsure[chosen[0]] >= unsure[chosen[1]]  # the least sure first
    assert list(choose(unsure[:3], read[:3], 5)) == list(np.argsort(-unsure[:3]))  # n beyond: all


def test_the_command_writes_the_unsure_texts_to_label_and_leaves_out_what_the_run_holds(quick_run, tmp_path):
    known = RunFolder(quick_run).read_split("train")["text"].tolist()[:3]
    fresh = toy_reviews(120, seed=7)["text"].drop_duplicates().tolist()
    rows = [*fresh, *known, fresh[0], "", fresh[1]]
    pool = pd.DataFrame({"ticket": range(len(rows)), "text": rows})
    pool.to_csv(tmp_path / "pool.csv", index=False)
    out = tmp_path / "next.csv"
    result = invoke("select", quick_run, "--pool", tmp_path / "pool.csv", "--n", "5", "--out", out)
    assert result.exit_code == 0, result.output
    chosen = pd.read_csv(out, keep_default_na=False)
    assert list(chosen.columns) == ["ticket", "text", "label", "predicted", "p_predicted", "uncertainty"]
    assert len(chosen) == 5 and (chosen["label"] == "").all()  # to fill in
    assert not set(chosen["text"]) & set(known) and chosen["text"].is_unique
    assert chosen["uncertainty"].is_monotonic_decreasing
    assert set(chosen["predicted"]) <= {"positive", "negative"}
    for note in ("3 texts the run already trained", "1 empty texts", "2 repeated texts"):
        assert note in result.output, result.output
    assert f"chose 5 of {len(fresh)} texts" in result.output and f"written to {out}" in result.output
    unsure = uncertainty(Classifier.load(quick_run).predict_probs(fresh))
    assert np.allclose(chosen["uncertainty"], unsure[[fresh.index(t) for t in chosen["text"]]], atol=1e-4)
    assert chosen["uncertainty"].min() >= np.sort(unsure)[-CANDIDATES * 5] - 1e-4  # among the least sure
    assert chosen["uncertainty"].min() > np.median(unsure)  # the unsure ones, not any


def test_the_least_sure_alone_with_no_diverse(quick_run, tmp_path):
    pool = pd.DataFrame({"text": toy_reviews(40, seed=3)["text"]})
    pool.to_csv(tmp_path / "pool.csv", index=False)
    out = tmp_path / "next.jsonl"
    result = invoke(
        "select", quick_run, "--pool", tmp_path / "pool.csv", "--n", "4", "--out", out, "--no-diverse"
    )
    assert result.exit_code == 0, result.output
    chosen = pd.read_json(out, lines=True)
    everyone = invoke(
        "select", quick_run, "--pool", tmp_path / "pool.csv", "--n", "40", "--out", tmp_path / "all.csv"
    )
    ranked = pd.read_csv(tmp_path / "all.csv")
    assert everyone.exit_code == 0 and len(ranked) == 40
    assert np.allclose(chosen["uncertainty"], ranked["uncertainty"].head(4))  # the top of the ranking


def test_outputs_and_pools_it_cannot_use_are_refused_before_the_model_loads(quick_run, tmp_path):
    result = invoke("select", quick_run, "--pool", tmp_path / "missing.csv")
    assert result.exit_code != 0 and "not found" in result.output
    (tmp_path / "pool.csv").write_text("text\nfine\n", encoding="utf-8")
    result = invoke("select", quick_run, "--pool", tmp_path / "pool.csv", "--out", tmp_path / "next.xlsx")
    assert result.exit_code != 0 and "next.xlsx: write .csv or .jsonl" in result.output
    result = invoke("select", tmp_path, "--pool", tmp_path / "pool.csv")
    assert result.exit_code != 0 and "neither a loracls run folder" in result.output
    result = invoke("select", quick_run, "--pool", tmp_path / "pool.csv", "--text-column", "review")
    assert result.exit_code != 0 and "no text column 'review'" in result.output


def test_candidates_that_coincide_still_give_n_distinct_texts():
    read = np.vstack([np.ones((6, 3)), np.zeros((2, 3)) + [1, 0, 0]])  # two distinct points
    unsure = np.linspace(0.9, 0.2, 8)
    chosen = choose(unsure, read, 4)
    assert len(set(chosen.tolist())) == 4 and list(unsure[chosen]) == sorted(unsure[chosen], reverse=True)
