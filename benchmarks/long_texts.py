"""Texts longer than the window: is reading them in windows worth it against cutting them?

    python benchmarks/long_texts.py --run RUN [--max-texts 1000] [--ways cut-128,...]
        [--out benchmarks/results/long_texts.json]

RUN is a finished run (e.g. `make demo`'s: zh-reviews at max_length 128). The texts are its data's texts over
the run's `max_length` tokens that it never trained on: its validation and test splits' and those of the
training split outside its training sample (up to `--max-texts`, the longest first). One classifier, the
run's best checkpoint, reads them each way:

  cut-N          the text cut at N tokens (N = the run's max_length: what the run does; 4N: the model reads
                 up to 4x the length it trained at)
  mean-S, max-S  overlapping windows of max_length tokens, S tokens apart, their probabilities averaged
                 (mean) or each label's highest (max)

Each way's accuracy and macro-F1 (and the accuracy on the texts a default may be chosen on, `choose`: the
training split's rest and validation; and on `test`), its seconds and the tokens it read per text, against
`cut` at the run's max_length (the named baseline), measured in one process one after another.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np
from common import RESULTS, write_result
from sklearn.metrics import accuracy_score, f1_score

from loracls.data.splits import load_splits
from loracls.inference.predict import Classifier
from loracls.training.runs import RunFolder


def unseen(run: RunFolder) -> tuple[list[str], list[str], list[str]]:
    """The texts of the run's data (its splits as `load_splits` draws them again, before any sampling)
    outside its training sample, their labels, and the split each came from (`choose`: the training split's
    rest and validation, where a default may be chosen; `test`)."""
    cfg = dataclasses.replace(run.read_config(), max_train_examples=None, max_eval_examples=None)
    splits = load_splits(cfg)
    trained = set(run.read_split("train")["text"])
    texts, labels, parts = [], [], []
    for part, table in (("choose", splits.train), ("choose", splits.val), ("test", splits.test)):
        for text, label in zip(table["text"], table["label"], strict=True):
            if text not in trained:
                texts.append(text)
                labels.append(label)
                parts.append(part)
    return texts, labels, parts


def tokens_read(lengths: np.ndarray, how: str, size: int, stride: int | None) -> int:
    """The text tokens a way reads (the prompt around each piece not counted)."""
    if how == "cut":
        return int(np.minimum(lengths, size).sum())
    return int(sum(n if n <= size else size * (len(range(0, n - size, stride)) + 1) for n in lengths))


def name(how: str, length: int, stride: int | None) -> str:
    return f"cut-{length}" if how == "cut" else f"{how}-{stride}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--max-texts", type=int, default=1000)
    parser.add_argument("--out", type=Path, default=RESULTS / "long_texts.json")
    parser.add_argument("--ways", help="Only these ways (cut-128,mean-63,...); the first is the baseline")
    args = parser.parse_args()
    run = RunFolder(args.run)
    classifier = Classifier.from_run(args.run)
    texts, labels, parts = unseen(run)
    size = classifier.max_length
    lengths = np.array([len(x) for x in classifier.tokenizer(texts, add_special_tokens=False)["input_ids"]])
    keep = np.argsort(-lengths, kind="stable")[: args.max_texts]
    keep = keep[lengths[keep] > size]
    texts, labels, lengths = [texts[i] for i in keep], [labels[i] for i in keep], lengths[keep]
    parts = np.array([parts[i] for i in keep])
    if not texts:
        raise SystemExit(f"{args.run}: its data has no unseen text over its max_length of {size} tokens")
    print(
        f"{len(texts)} texts over {size} tokens (median {int(np.median(lengths))}, longest {lengths.max()})"
    )
    window = classifier.window()  # the text tokens a window holds (max_length less a bare text's specials)
    ways = [("cut", size, None), ("cut", 4 * size, None)]
    ways += [(how, size, stride) for how in ("mean", "max") for stride in (window // 2, window)]
    ways = [way for way in ways if not args.ways or name(*way) in args.ways.split(",")]
    rows = []
    for how, length, stride in ways:
        classifier.max_length, classifier.long_texts, classifier.stride = length, how, stride
        read = tokens_read(lengths, how, length if how == "cut" else window, stride)
        started = time.perf_counter()
        probs = classifier.predict_probs(texts, f"{how} {length} {stride or ''}")
        seconds = time.perf_counter() - started
        predicted = [classifier.labels[i] for i in probs.argmax(1)]
        gold, predicted = np.array(labels), np.array(predicted)
        rows.append(
            {
                "way": name(how, length, stride),
                "accuracy": accuracy_score(gold, predicted),
                "macro_f1": f1_score(gold, predicted, average="macro"),
                **{
                    f"{part}_accuracy": accuracy_score(gold[parts == part], predicted[parts == part])
                    for part in ("choose", "test")
                },
                "seconds": round(seconds, 1),
                "tokens_per_text": round(read / len(texts), 1),
            }
        )
        print(rows[-1])
    base = rows[0]
    for row in rows:
        row["seconds_vs_cut"] = round(row["seconds"] / base["seconds"], 2)
        row["accuracy_vs_cut"] = round(row["accuracy"] - base["accuracy"], 4)
    write_result(
        args.out,
        {
            "question": "texts over the window: cut, cut at 4x, or windows (mean / max) against cut at "
            "max_length",
            "run": str(args.run),
            "data": run.read_config().data,
            "max_length": size,
            "texts": len(texts),
            "texts_by_part": {part: int((parts == part).sum()) for part in ("choose", "test")},
            "median_tokens": int(np.median(lengths)),
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
