"""Can the prompt search and the baseline score each label word by its first tokens only, as many as tell the
labels apart (`telling_prefixes` here), instead of all of them, and still choose as good a prompt?

Baseline: every token of every label word (`label_log_probs` on the whole words, the scorer before this
script). A word's later tokens each cost a vocabulary-wide row of logits per prompt: BANKING77's raw codes
(`balance_not_updated_after_bank_transfer`) are 11 tokens. Candidate: the telling prefixes. Per task, every
candidate prompt of the search (`plan_search`) reads the search's training sample and validation texts both
ways; the ways take turns group by group (the order flips each group) in one process.

Reported per task: seconds and later tokens scored per prompt, each way; per candidate its validation
macro-F1 both ways and how often the two agree; and the prompt each way's search would choose on the
training sample (best macro-F1, then the higher mean log-probability of the right label), judged by its
validation macro-F1 under its own scoring (what the baseline would report) and under whole words.

    python benchmarks/label_prefix.py [--tasks zh-reviews,en-tweets,banking77-10,banking77] [--val 300]
        [--sample 128] [--out benchmarks/results/label_prefix.json]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, write_result
from prompt_rounds import best
from tasks import banking77_splits, builtin_splits, training_sample

from loracls.config import TrainConfig
from loracls.data.labels import label_ids
from loracls.data.prompts import Prompter
from loracls.data.splits import stratified_sample
from loracls.environment.devices import inference_autocast
from loracls.lora import linears_as_computed
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.objective import label_log_probs, later_tokens
from loracls.training.evaluate import score
from loracls.training.prompt_search import plan_search, softmax

WAYS = ("whole words", "telling prefixes")


def telling_prefixes(tokens: list[list[int]]) -> list[list[int]]:
    """Each label word's tokens cut to the fewest that still tell every word apart: the first k tokens of
    each (a word of fewer tokens whole), at the least k where no two labels' cut words are the same."""
    for k in range(1, max(len(ids) for ids in tokens) + 1):
        cut = [ids[:k] for ids in tokens]
        if len({tuple(ids) for ids in cut}) == len(cut):
            return cut
    return tokens


def task_tables(task: str, val_n: int):
    """(training sample, validation texts) of a task: 2,000 training examples of the built-in sets; of
    BANKING77, 30 a label (`banking77-10`: its 10 most frequent intents)."""
    if task.startswith("banking77"):
        per_label = max(2, val_n // (10 if task == "banking77-10" else 77))
        pool, val, _ = banking77_splits(77 * per_label, 800)
        if task == "banking77-10":
            top = list(pool["label"].value_counts().index[:10])
            pool, val = pool[pool["label"].isin(top)], val[val["label"].isin(top)]
        train = training_sample(pool, "30/class", 0)
    else:
        pool, val, _ = builtin_splits(task, val_n, 200)
        train = training_sample(pool, "2000", 0)
    as_text = {"label": lambda t: t["label"].astype(str)}
    return train.assign(**as_text), val.assign(**as_text).reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="zh-reviews,en-tweets,banking77-10,banking77")
    parser.add_argument("--val", type=int, default=300, help="validation texts a task")
    parser.add_argument("--sample", type=int, default=128, help="the search's sample")
    parser.add_argument("--out", type=Path, default=RESULTS / "label_prefix.json")
    args = parser.parse_args()
    path = resolve_model("gemma3-270m")
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    device = torch.device("cpu")
    tasks, candidates_rows = [], []
    with inference_autocast(device):
        linears_as_computed(model, device.type)
        for task in args.tasks.split(","):
            train, val = task_tables(task, args.val)
            labels = sorted(train["label"].unique())
            cfg = TrainConfig(seed=0, max_length=128, prompt_sample=args.sample)
            plan = plan_search(tokenizer, train, labels, cfg)
            sample = stratified_sample(train, plan.sample, 0).reset_index(drop=True)
            ids = label_ids(labels)
            gold = np.array([ids[x] for x in sample["label"]])
            probs = {way: {"sample": {}, "val": {}} for way in WAYS}
            seconds = dict.fromkeys(WAYS, 0.0)
            later = dict.fromkeys(WAYS, 0)
            for g, group in enumerate(plan.groups):
                prompter = Prompter(tokenizer, plan.candidates[group[0][0]], [], cfg.max_length)
                words = [[t[label] for label in labels] for _, t in group]
                columns = {
                    WAYS[0]: [ids for each in words for ids in each],
                    WAYS[1]: [ids for each in words for ids in telling_prefixes(each)],
                }
                for part, table in (("sample", sample), ("val", val)):
                    prompts = prompter.encode(list(table["text"]))
                    for way in WAYS if g % 2 == 0 else WAYS[::-1]:
                        started = time.perf_counter()
                        every = label_log_probs(model, tokenizer, prompts, columns[way])
                        seconds[way] += time.perf_counter() - started
                        for k, (n, _) in enumerate(group):
                            probs[way][part][n] = softmax(every[:, k * len(labels) : (k + 1) * len(labels)])
                for way in WAYS:
                    later[way] += later_tokens(columns[way])
            scored = sorted(probs[WAYS[0]]["val"])
            for n in scored:
                whole, cut = probs[WAYS[0]]["val"][n], probs[WAYS[1]]["val"][n]
                row = {
                    "task": task,
                    "candidate": n,
                    "template": plan.rows[n]["template"],
                    "verbalizers": plan.rows[n]["verbalizers"][:120],
                    "val_macro_f1_whole": round(score(val, whole, labels)["macro_f1"], 4),
                    "val_macro_f1_prefix": round(score(val, cut, labels)["macro_f1"], 4),
                    "agreement": round(float((whole.argmax(1) == cut.argmax(1)).mean()), 4),
                }
                candidates_rows.append(row)
                print(
                    f"{task} {row['template']:13s} {row['verbalizers'][:40]:40s} val macro-F1 "
                    f"{row['val_macro_f1_whole']:.3f} / {row['val_macro_f1_prefix']:.3f}"
                    f" agree {row['agreement']:.3f}",
                    flush=True,
                )
            every = np.arange(len(sample))
            chosen = {way: best(scored, probs[way]["sample"], every, gold, labels) for way in WAYS}
            summary = {
                "task": task,
                "labels": len(labels),
                "candidates": len(scored),
                "groups": len(plan.groups),
                "sample": len(sample),
                "val": len(val),
                "prompts_per_way": (len(sample) + len(val)) * len(plan.groups),
            }
            for way in WAYS:
                n = chosen[way]
                val_scores = score(val, probs[way]["val"][n], labels)
                summary[way] = {
                    "seconds": round(seconds[way], 1),
                    "later_tokens_per_prompt": later[way] / len(plan.groups),
                    "chosen": f"{plan.rows[n]['template']} ({plan.rows[n]['verbalizers'][:80]})",
                    "val_macro_f1": round(val_scores["macro_f1"], 4),
                    "val_accuracy": round(val_scores["accuracy"], 4),
                    "val_macro_f1_whole_words": round(
                        score(val, probs[WAYS[0]]["val"][n], labels)["macro_f1"], 4
                    ),
                }
            summary["speed_vs_whole"] = round(seconds[WAYS[0]] / seconds[WAYS[1]], 3)
            summary["same_choice"] = chosen[WAYS[0]] == chosen[WAYS[1]]
            tasks.append(summary)
            print(
                f"{task}: whole {seconds[WAYS[0]]:.0f} s, prefixes {seconds[WAYS[1]]:.0f} s "
                f"({summary['speed_vs_whole']:.2f}x); chosen {summary[WAYS[0]]['chosen'][:50]} "
                f"{summary[WAYS[0]]['val_macro_f1']:.3f} vs {summary[WAYS[1]]['chosen'][:50]} "
                f"{summary[WAYS[1]]['val_macro_f1']:.3f}",
                flush=True,
            )
            write_result(
                args.out,
                {
                    "question": "score label words by their telling prefixes instead of every token",
                    "baseline": WAYS[0],
                    "tasks": tasks,
                    "candidates": candidates_rows,
                },
            )


if __name__ == "__main__":
    main()
