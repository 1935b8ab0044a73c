"""Can the prompt search score every candidate on part of its sample and only the best few on the rest, and
still choose as good a prompt? The search (`prompt: auto`) reads each candidate prompt around each of
`prompt_sample` (128) training texts; on zh-reviews that is 8 candidates, 1,024 prompts, a quarter of a
`make demo` run.

Baseline: the whole search, every candidate on the whole sample (`choose_prompt` before the rounds).
Candidates: two rounds, every candidate on the first `F` texts of the sample (a stratified part), then the
best quarter of the candidates (at least 2) on the rest; the choice among those on the whole sample. Each
task and seed's candidates are scored once on the whole sample; every way is then the choice it would make
from those scores (the same numbers, so the ways differ only in what they look at). The chosen prompts are
judged where the defaults may be chosen: their zero-shot macro-F1 on the validation texts (never test).

    python benchmarks/prompt_rounds.py [--tasks zh-reviews,en-tweets] [--seeds 5] [--val 300]
        [--firsts 16,32,48] [--out benchmarks/results/prompt_rounds.json]

BANKING77 (`--tasks banking77`) has no second round: 77 labels at 2 a label fill the whole sample.

Cost is the count of prompts each way reads (its time is in proportion: one forward pass reads a prompt);
the seconds of the whole search are printed beside it.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from common import RESULTS, write_result
from tasks import banking77_splits, builtin_splits, training_sample

from loracls.config import TrainConfig
from loracls.data.labels import label_ids
from loracls.data.prompts import Prompter
from loracls.data.splits import stratified_sample
from loracls.environment.devices import inference_autocast
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.objective import label_log_probs
from loracls.training.evaluate import score
from loracls.training.prompt_search import KEPT_LEAST, KEPT_SHARE, MIN_PER_LABEL, plan_search, softmax

SIZES = {"zh-reviews": "2000", "en-tweets": "2000", "banking77": "30/class"}


def candidate_scores(
    model, tokenizer, plan, table: pd.DataFrame, labels: list[str], cfg
) -> dict[int, np.ndarray]:
    """Each scored candidate's label probabilities on `table`'s texts (rows in its order)."""
    scores = {}
    for group in plan.groups:
        prompter = Prompter(tokenizer, plan.candidates[group[0][0]], [], cfg.max_length)
        prompts = prompter.encode(list(table["text"]))
        every = label_log_probs(model, tokenizer, prompts, [t[label] for _, t in group for label in labels])
        for k, (n, _) in enumerate(group):
            scores[n] = softmax(every[:, k * len(labels) : (k + 1) * len(labels)])
    return scores


def best(
    candidates: list[int], scores: dict[int, np.ndarray], rows: np.ndarray, gold: np.ndarray, labels
) -> int:
    """The candidate `choose_prompt` takes on the sample rows `rows`: the best macro-F1, then the higher mean
    log-probability of the right label, then the earlier candidate."""

    return max(candidates, key=lambda n: _key(scores[n][rows], gold[rows], labels, n))


def rounds(plan, scores, gold, labels, first: np.ndarray, rest: np.ndarray) -> tuple[int, int, int]:
    """(chosen candidate, prompts read, groups kept) of a two-round search: every candidate on `first`, the
    best quarter of the groups (at least 2; a group's rank: its best candidate on `first`) on the rest too."""
    groups = plan.groups
    keep = max(KEPT_LEAST, math.ceil(KEPT_SHARE * len(groups)))  # as `prompt_search.search_rounds` keeps
    if keep >= len(groups):
        every = [n for g in groups for n, _ in g]
        return best(every, scores, np.arange(len(gold)), gold, labels), len(groups) * len(gold), len(groups)
    leaders = [best([n for n, _ in g], scores, first, gold, labels) for g in groups]
    ranked = sorted(
        range(len(groups)), key=lambda i: _key(scores[leaders[i]][first], gold[first], labels, leaders[i])
    )[::-1]
    kept = [n for i in ranked[:keep] for n, _ in groups[i]]
    chosen = best(kept, scores, np.arange(len(gold)), gold, labels)
    return chosen, len(groups) * len(first) + keep * len(rest), keep


def _key(probs: np.ndarray, gold: np.ndarray, labels: list[str], n: int) -> tuple[float, float, int]:
    table = pd.DataFrame({"label": [labels[g] for g in gold]})
    f1 = score(table, probs, labels)["macro_f1"]
    return f1, float(np.log(probs[np.arange(len(gold)), gold]).mean()), -n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="zh-reviews,en-tweets")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--val", type=int, default=300, help="validation texts the chosen prompts are judged on"
    )
    parser.add_argument("--firsts", default="16,32,48", help="texts of the first round, per way")
    parser.add_argument("--out", type=Path, default=RESULTS / "prompt_rounds.json")
    args = parser.parse_args()
    path = resolve_model("gemma3-270m")
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    firsts = [int(f) for f in args.firsts.split(",")]
    rows = []
    with inference_autocast(torch.device("cpu")):
        for task in args.tasks.split(","):
            if task == "banking77":
                pool, val, _ = banking77_splits(args.val, 800)
            else:
                pool, val, _ = builtin_splits(task, args.val, 800)
            for seed in range(args.seeds):
                train = training_sample(pool, SIZES[task], seed)
                labels = sorted(train["label"].astype(str).unique())
                train = train.assign(label=train["label"].astype(str))
                cfg = TrainConfig(seed=seed, max_length=128)
                plan = plan_search(tokenizer, train, labels, cfg)
                sample = stratified_sample(train, plan.sample, seed)
                gold = np.array([label_ids(labels)[x] for x in sample["label"]])
                started = time.perf_counter()
                scores = candidate_scores(model, tokenizer, plan, sample, labels, cfg)
                search_s = time.perf_counter() - started
                every = sorted(scores)
                ways = {
                    "whole sample": (
                        best(every, scores, np.arange(len(gold)), gold, labels),
                        len(plan.groups) * len(gold),
                        len(plan.groups),
                    )
                }
                for f in firsts:
                    if max(f, MIN_PER_LABEL * len(labels)) >= len(sample):
                        continue  # one round: the whole sample, as the search does
                    part = stratified_sample(sample.reset_index(drop=True), f, seed)
                    first = part.index.to_numpy()
                    rest = np.setdiff1d(np.arange(len(sample)), first)
                    ways[f"rounds, first {f}"] = rounds(plan, scores, gold, labels, first, rest)
                chosen = sorted({c for c, _, _ in ways.values()})
                val_table = val.assign(label=val["label"].astype(str))
                val_scores = candidate_scores(
                    model, tokenizer, plan_only(plan, chosen), val_table, labels, cfg
                )
                full_prompts = ways["whole sample"][1]
                for way, (n, prompts, kept) in ways.items():
                    metrics = score(val_table, val_scores[n], labels)
                    row = {
                        "task": task,
                        "seed": seed,
                        "way": way,
                        "candidates": len(every),
                        "groups": len(plan.groups),
                        "groups_kept": kept,
                        "sample": len(sample),
                        "chosen": f"{plan.rows[n]['template']} ({plan.rows[n]['verbalizers']})",
                        "same_as_whole": n == ways["whole sample"][0],
                        "prompts": prompts,
                        "cost_vs_whole": round(prompts / full_prompts, 3),
                        "val_macro_f1": round(metrics["macro_f1"], 4),
                        "val_accuracy": round(metrics["accuracy"], 4),
                        "whole_search_s": round(search_s, 1),
                    }
                    rows.append(row)
                    print(
                        f"{task} seed {seed} {way:18s} {row['chosen'][:60]:60s}"
                        f" same {row['same_as_whole']!s:5s} cost {row['cost_vs_whole']:.2f}"
                        f" val macro-F1 {row['val_macro_f1']:.3f}",
                        flush=True,
                    )
                write(args.out, rows)  # after every point: a long run keeps what it measured


def write(out: Path, rows: list[dict]) -> None:
    """The result so far: every row, and per way how often it chose the whole search's prompt, the mean
    validation macro-F1 of its choices and its share of the whole search's prompts."""
    summary = {}
    for way in dict.fromkeys(r["way"] for r in rows):
        mine = [r for r in rows if r["way"] == way]
        summary[way] = {
            "same_as_whole": f"{sum(r['same_as_whole'] for r in mine)} of {len(mine)}",
            "mean_val_macro_f1": round(float(np.mean([r["val_macro_f1"] for r in mine])), 4),
            "mean_cost_vs_whole": round(float(np.mean([r["cost_vs_whole"] for r in mine])), 3),
        }
        print(way, summary[way])
    write_result(
        out,
        {
            "question": "a prompt search in two rounds: as good a prompt (validation macro-F1) at what "
            "share of the prompts?",
            "baseline": "whole sample",
            "rows": rows,
            "summary": summary,
        },
    )


def plan_only(plan, candidates: list[int]):
    """`plan` with only the groups (and in them the candidates) in `candidates`."""
    groups = [[(n, t) for n, t in g if n in candidates] for g in plan.groups]
    return type(plan)(**{**plan.__dict__, "groups": [g for g in groups if g]})


if __name__ == "__main__":
    main()
