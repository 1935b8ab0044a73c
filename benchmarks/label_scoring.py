"""What does scoring the label words after a prompt cost as the number of labels grows? The prompt search, the
prompt baseline and `objective: lm` all read each label word's log-probability after each text's prompt.

Baseline (named `per-label rows`, the scorer before this one, kept here): every distinct multi-token label
word is a sequence of its own, prompt + word, so a text costs one prompt-length pass per label. Candidate:
`loracls.objective.label_log_probs` today: one pass per prompt, the later tokens of every label as short
rows on the prompt's key/value cache. Both score the same texts and words on the embedded Gemma 3 270M; the
script asserts they agree and prints seconds per text (the fastest of `--rounds` alternating rounds) and
the ratio.

    python benchmarks/label_scoring.py [--texts 32] [--tasks banking77,zh-reviews] [--out ...]

Tasks: BANKING77 (77 intents, the readable label words `card arrival`, `card linking`, ..., most of them
several tokens) and zh-reviews (2 labels, one token each: nothing to gain, nothing to lose).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from common import RESULTS, write_result

from loracls.config import PromptConfig, TrainConfig
from loracls.data.prompts import Prompter, candidate_prompts
from loracls.data.splits import load_splits
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.objective import label_log_probs

BANKING77 = Path(__file__).parent / "data" / "banking77"


@torch.inference_mode()
def per_label_rows(model, tokenizer, prompts: list[list[int]], tokens: list[list[int]], batch_size: int = 16):
    """The scorer before today's: one right-padded sequence per prompt and distinct label-word prefix (a
    shorter word rides on a longer one that starts with it), the LM head applied where a word token is
    read."""
    jobs: dict[tuple[int, ...], list[tuple[int, int, int]]] = {}
    longest_first = sorted(range(len(tokens)), key=lambda k: -len(tokens[k]))
    for i, prompt in enumerate(prompts):
        hosts: list[tuple[int, ...]] = []
        for k in longest_first:
            wanted = tuple(prompt + tokens[k][:-1])
            host = next((h for h in hosts if h[: len(wanted)] == wanted), None)
            if host is None:
                host = wanted
                hosts.append(host)
            jobs.setdefault(host, []).append((i, k, len(prompt) - 1))
    sequences = sorted(jobs, key=len, reverse=True)
    pad = tokenizer.pad_token_id
    scores = np.zeros((len(prompts), len(tokens)), dtype=np.float64)
    for start in range(0, len(sequences), batch_size):
        batch = sequences[start : start + batch_size]
        width = len(batch[0])
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        needed = []
        for row, seq in enumerate(batch):
            input_ids[row, : len(seq)] = torch.tensor(seq)
            attention_mask[row, : len(seq)] = 1
            needed.append(
                [(i, k, first + j, token) for i, k, first in jobs[seq] for j, token in enumerate(tokens[k])]
            )
        positions = sorted({p for row in needed for _, _, p, _ in row})
        logits = model(
            input_ids=input_ids, attention_mask=attention_mask, logits_to_keep=torch.tensor(positions)
        ).logits
        log_probs = torch.log_softmax(logits.float(), dim=-1)
        column = {p: c for c, p in enumerate(positions)}
        for row, items in enumerate(needed):
            for i, k, position, token in items:
                scores[i, k] += float(log_probs[row, column[position], token])
    return scores, len(sequences)


def task_texts(task: str, n: int) -> tuple[list[str], list[str]]:
    """n texts of the task and its labels."""
    if task == "banking77":
        table = pd.read_csv(BANKING77 / "train.csv").rename(columns={"category": "label"})
    else:
        table = load_splits(TrainConfig(data=task, seed=42)).train
    labels = sorted(table["label"].astype(str).unique())
    return list(table.sample(n, random_state=0)["text"]), labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--texts", type=int, default=32)
    parser.add_argument("--tasks", default="banking77,zh-reviews")
    parser.add_argument(
        "--rounds", type=int, default=2, help="timed rounds of each scorer (the fastest counts)"
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "label_scoring.json")
    args = parser.parse_args()
    path = resolve_model("gemma3-270m")
    model, tokenizer = load_causal_lm(path).eval(), load_tokenizer(path)
    rows = []
    for task in args.tasks.split(","):
        texts, labels = task_texts(task, args.texts)
        # the last candidate the search would score: for BANKING77 the readable label words
        prompt = candidate_prompts(labels, texts, PromptConfig())[-1]
        prompter = Prompter(tokenizer, prompt, [], 256)
        tokens = prompter.label_tokens()
        columns = [tokens[label] for label in labels]
        prompts = prompter.encode(texts)
        label_log_probs(model, tokenizer, prompts[:2], columns)  # warm up both paths once
        timed: dict[str, tuple[float, object]] = {}
        for _ in range(args.rounds):  # alternating, the fastest round of each: a shared CPU's load moves
            for name, scorer in (("per-label rows", per_label_rows), ("today", label_log_probs)):
                started = time.perf_counter()
                scores = scorer(model, tokenizer, prompts, columns)
                seconds = time.perf_counter() - started
                if name not in timed or seconds < timed[name][0]:
                    timed[name] = (seconds, scores)
        old, (new_s, new) = timed["per-label rows"], timed["today"]
        (old_s, (old_scores, sequences)) = old
        np.testing.assert_allclose(new, old_scores, rtol=1e-3, atol=2e-2)  # the same answers
        agree = float((new.argmax(1) == old_scores.argmax(1)).mean())
        row = {
            "task": task,
            "labels": len(labels),
            "texts": len(texts),
            "prompt": prompt.name,
            "word_tokens_mean": round(float(np.mean([len(c) for c in columns])), 2),
            "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1),
            "baseline_sequences": sequences,
            "baseline_s_per_text": round(old_s / len(texts), 4),
            "today_s_per_text": round(new_s / len(texts), 4),
            "speedup": round(old_s / new_s, 2),
            "max_abs_diff": round(float(np.abs(new - old_scores).max()), 5),
            "argmax_agreement": agree,
        }
        rows.append(row)
        print(
            f"{task}: {len(labels)} labels, {row['word_tokens_mean']} tokens a word; per-label rows "
            f"{row['baseline_s_per_text']:.3f} s/text ({sequences} sequences), today "
            f"{row['today_s_per_text']:.3f} s/text: {row['speedup']:.1f}x; max |diff| {row['max_abs_diff']}, "
            f"same top label {agree:.0%}"
        )
    write_result(
        args.out,
        {
            "question": "seconds per text to score every label word after a prompt, as the labels grow",
            "baseline": "per-label rows (the scorer before today's)",
            "rounds": args.rounds,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
