"""Does reading a text as prompt pieces change what the prompt gets right? An export's tokenizer adds the
run's prompt to any raw text (`loracls.inference.export.prompt_in_tokenizer`), which needs loracls to
tokenise the prompt's prefix, the text and the suffix apart and join the ids (`Prompter(pieces=True)`, the
default). Before, it tokenised the joined string (`pieces=False`, the named baseline here); the two differ
where a token would span the seam, as in English `Text: great` (`: ▁great` joined, `: ▁ great` in pieces).

For each task's candidate prompts (those `prompt: auto` scores, the first `--candidates`), on the same texts
with the embedded Gemma 3 270M: the zero-shot accuracy and macro-F1 of the label word ranked first, read
both ways, the share of texts whose ids are the same both ways, and whether the search's best candidate
(by macro-F1) stays the same.

    python benchmarks/prompt_pieces.py [--texts 120] [--candidates 6] [--tasks en-tweets,zh-reviews,banking77]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
from common import RESULTS, write_result
from sklearn.metrics import accuracy_score, f1_score

from loracls.config import PromptConfig, TrainConfig
from loracls.data.prompts import Prompter, candidate_prompts
from loracls.data.splits import load_splits
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.objective import label_log_probs

BANKING77 = Path(__file__).parent / "data" / "banking77"


def task_table(task: str, n: int) -> pd.DataFrame:
    """n labelled texts: a built-in set's validation split, BANKING77's training file (its test is kept)."""
    if task == "banking77":
        table = pd.read_csv(BANKING77 / "train.csv").rename(columns={"category": "label"})
    else:
        table = load_splits(TrainConfig(data=task, seed=42)).val
    return table.sample(min(n, len(table)), random_state=0).reset_index(drop=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=120)
    parser.add_argument("--candidates", type=int, default=6)
    parser.add_argument("--tasks", default="en-tweets,zh-reviews,banking77")
    parser.add_argument("--banking77-texts", type=int, default=40, help="77 words a text: fewer texts")
    parser.add_argument("--out", type=Path, default=RESULTS / "prompt_pieces.json")
    args = parser.parse_args()
    path = resolve_model("gemma3-270m")
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    rows = []
    for task in args.tasks.split(","):
        table = task_table(task, args.banking77_texts if task == "banking77" else args.texts)
        texts, gold = list(table["text"]), list(table["label"].astype(str))
        labels = sorted(set(gold))
        candidates = candidate_prompts(labels, texts, PromptConfig())[: args.candidates]
        for prompt in candidates:
            row = {"task": task, "labels": len(labels), "texts": len(texts), "prompt": prompt.name}
            row["words"] = "readable" if any(w != k for k, w in prompt.words.items()) else "names"
            ids = {}
            for mode, pieces in (("joined", False), ("pieces", True)):
                prompter = Prompter(tokenizer, prompt, [], 128, pieces=pieces)
                tokens = prompter.label_tokens()
                ids[mode] = prompter.encode(texts)
                scores = label_log_probs(model, tokenizer, ids[mode], [tokens[label] for label in labels])
                predicted = [labels[k] for k in np.asarray(scores).argmax(1)]
                row[f"{mode}_accuracy"] = round(accuracy_score(gold, predicted), 4)
                row[f"{mode}_macro_f1"] = round(f1_score(gold, predicted, average="macro"), 4)
            row["same_ids"] = round(float(np.mean([a == b for a, b in zip(*ids.values(), strict=True)])), 4)
            rows.append(row)
            print(
                f"{task} {prompt.name} ({row['words']}): accuracy joined {row['joined_accuracy']:.3f}, "
                f"pieces {row['pieces_accuracy']:.3f}; macro-F1 {row['joined_macro_f1']:.3f} / "
                f"{row['pieces_macro_f1']:.3f}; same ids on {row['same_ids']:.0%} of texts",
                flush=True,
            )
    summary = {}
    for task in dict.fromkeys(r["task"] for r in rows):
        mine = [r for r in rows if r["task"] == task]
        gaps = [r["pieces_macro_f1"] - r["joined_macro_f1"] for r in mine]
        best = {mode: max(mine, key=lambda r, m=mode: r[f"{m}_macro_f1"]) for mode in ("joined", "pieces")}
        summary[task] = {
            "macro_f1_gap_mean": round(float(np.mean(gaps)), 4),
            "macro_f1_gap_min": round(float(np.min(gaps)), 4),
            "macro_f1_gap_max": round(float(np.max(gaps)), 4),
            "best_joined": f"{best['joined']['prompt']} {best['joined']['joined_macro_f1']}",
            "best_pieces": f"{best['pieces']['prompt']} {best['pieces']['pieces_macro_f1']}",
        }
        print(f"{task}: pieces - joined macro-F1 over {len(mine)} prompts {summary[task]}")
    write_result(
        args.out,
        {
            "question": "zero-shot accuracy of a prompt read as pieces (prefix, text, suffix apart) or "
            "joined",
            "baseline": "joined: the prompt and the text tokenised as one string (loracls before exports "
            "carried the prompt in their tokenizer)",
            "rows": rows,
            "summary": summary,
        },
    )


if __name__ == "__main__":
    main()
