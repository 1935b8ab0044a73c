"""Where a verbaliser-initialised head should start when label words are several tokens: the LM head's row
of each word's first token after the shared start (what loracls uses where those differ between all labels),
or the mean of the rows of all its tokens (what it uses where they do not). Both heads read the same hidden
state (the prompt's end), so each is scored at step 0, untrained, on validation texts: macro-F1 and accuracy,
beside the zero-shot prompt that scores whole words (the sum of their tokens' log-probabilities). The
first-token head exists only where every label parts on a different token; many intents (`card arrival`,
`card linking`) do not.

    python benchmarks/head_rows.py --tasks zh-reviews en-tweets --texts 500   # what `make numbers` runs
    python benchmarks/head_rows.py --texts 500   # BANKING77 too (slow: whole words of 77 intents)
    python benchmarks/head_rows.py --quick    # 80 texts a task (BANKING77 needs one per intent)
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch
from common import write_result
from sklearn.metrics import accuracy_score, f1_score

from loracls.config import TrainConfig
from loracls.data.prompts import Prompter, answer_tokens, part_on_first_token, readable_words, resolve_prompt
from loracls.data.splits import load_splits
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.objective import label_log_probs

BANKING77 = Path(__file__).resolve().parents[2] / "shared/data/banking77/train.csv"

TASKS = {
    # name: (data, label column, prompt, label words: None = the prompt's own, "readable" = readable_words)
    "zh-reviews": ("zh-reviews", "label", "zh-sentiment", "negative=负面,positive=正面"),
    "en-tweets": ("en-tweets", "label", "en-sentiment", None),
    "banking77": (str(BANKING77), "category", "en-label", "readable"),
}


def scores(y: np.ndarray, predicted: np.ndarray) -> dict:
    return {
        "accuracy": round(float(accuracy_score(y, predicted)), 4),
        "macro_f1": round(float(f1_score(y, predicted, average="macro")), 4),
    }


def measure(task: str, texts_per_task: int, model_path: str) -> dict:
    data, label_column, template, words = TASKS[task]
    splits = load_splits(TrainConfig(data=data, label_column=label_column, max_eval_examples=texts_per_task))
    labels = splits.labels
    verbalizers = words if words != "readable" else readable_words(labels)
    tokenizer, lm = load_tokenizer(model_path), load_causal_lm(model_path)
    prompt = resolve_prompt(labels, [], TrainConfig(prompt=template, verbalizers=verbalizers))
    shared, following = answer_tokens(tokenizer, prompt, labels)
    prompter = Prompter(tokenizer, prompt, [], 64, shared)
    table = splits.val
    gold = np.array([labels.index(x) for x in table["label"]])
    encoded = prompter.encode(list(table["text"]))
    weight = lm.get_output_embeddings().weight.detach().float()
    rows = {"mean of all tokens": torch.stack([weight[ids].mean(0) for ids in following])}
    if part_on_first_token(following):
        rows["first token"] = weight[[ids[0] for ids in following]]
    started = time.perf_counter()
    hidden = []
    with torch.no_grad():
        for ids in encoded:
            out = lm.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1].float()
            hidden.append(out)
        hidden = torch.stack(hidden)
        zero_shot = label_log_probs(lm, tokenizer, encoded, following)
    result = {
        "task": task,
        "labels": len(labels),
        "texts": len(table),
        "prompt": template,
        "multi_token_words": sum(len(ids) > 1 for ids in following),
        "first_tokens_distinct": "first token" in rows,
        "zero-shot (whole words)": scores(gold, zero_shot.argmax(1)),
    }
    for name, matrix in rows.items():
        result[f"head at step 0: {name}"] = scores(gold, (hidden @ matrix.T).argmax(1).numpy())
    result["seconds"] = round(time.perf_counter() - started, 1)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--texts", type=int, default=600, help="validation texts per task")
    parser.add_argument("--quick", action="store_true", help="80 texts a task")
    parser.add_argument("--out", default="benchmarks/results/head_rows.json")
    args = parser.parse_args()
    texts = 80 if args.quick else args.texts
    model_path = resolve_model("gemma3-270m")
    rows = []
    for task in args.tasks:
        rows.append(measure(task, texts, model_path))
        print(rows[-1], flush=True)
    write_result(Path(args.out), {"model": "gemma3-270m", "texts": texts, "rows": rows})


if __name__ == "__main__":
    main()
