"""Does `loracls data audit` find wrong labels, and does dropping what it flags give back the accuracy they
cost? Labels flipped on purpose are the known answer.

    python benchmarks/audit.py [--noise 0.1] [--seed 0] [--no-train] [--out benchmarks/results/audit.json]
        [KEY=VALUE ...]

The demo's data (configs/demo.yaml: 2,000 training reviews of zh-reviews; KEY=VALUE changes it, e.g.
data=en-tweets) has `--noise` of its training labels flipped at random (seeded) to another label; validation
and test stay clean. The audit reads the noisy training rows; precision and recall of its flagged rows
against the flipped ones follow, and what it flags in the rows as shipped (nothing flipped: the data's own
noise, which the precision counts against it). Unless `--no-train`, `loracls train` with the demo's settings
(no prompt baseline) then runs three times on the same validation and test rows: (a) on the noisy training
rows, (b) on them without the flagged ones, (c) on the clean ones; `recovered` is the share of (c) - (a) that
(b) gets back. The audit's wall time is given against (a)'s.
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

import numpy as np
from common import RESULTS, write_result

from loracls.config import TrainConfig, parse_overrides
from loracls.data.splits import load_splits
from loracls.training.audit import audit
from loracls.training.train import train

CONFIG = Path(__file__).parents[1] / "configs/demo.yaml"


def flip(labels: list[str], share: float, seed: int) -> tuple[list[str], np.ndarray]:
    """`labels` with `share` of them (chosen at random) replaced by another label, and which were."""
    rng = np.random.default_rng(seed)
    names = sorted(set(labels))
    flipped = rng.choice(len(labels), size=round(share * len(labels)), replace=False)
    noisy = list(labels)
    for i in flipped:
        noisy[i] = rng.choice([n for n in names if n != labels[i]])
    return noisy, np.sort(flipped)


def trained_accuracy(cfg: TrainConfig, train_csv: Path, folder: Path, name: str) -> dict:
    """Test accuracy and macro-F1 of `loracls train` on `train_csv` with `cfg`'s other settings."""
    run_cfg = dataclasses.replace(cfg, data=str(train_csv), out=str(folder / name))
    started = time.perf_counter()
    _, metrics = train(run_cfg)
    seconds = time.perf_counter() - started
    result = {"accuracy": metrics["test"]["accuracy"], "macro_f1": metrics["test"]["macro_f1"]}
    print(
        f"({name}) test accuracy {result['accuracy']:.4f}, macro-F1 {result['macro_f1']:.4f}, {seconds:.0f} s"
    )
    return result | {"seconds": round(seconds, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--noise", type=float, default=0.1, help="share of training labels flipped")
    parser.add_argument("--seed", type=int, default=0, help="which labels are flipped")
    parser.add_argument("--no-train", action="store_true", help="measure the audit only")
    parser.add_argument("--out", type=Path, default=RESULTS / "audit.json")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="changes to configs/demo.yaml")
    args = parser.parse_args()
    overrides = parse_overrides(args.overrides)
    cfg = TrainConfig.load(CONFIG, overrides)
    splits = load_splits(cfg)
    folder = Path(tempfile.mkdtemp(prefix="audit-bench-"))
    clean = splits.train.assign(id=range(len(splits.train)))[["id", "text", "label"]]
    noisy_labels, flipped = flip(list(clean["label"]), args.noise, args.seed)
    noisy = clean.assign(label=noisy_labels)
    for name, table in (("clean", clean), ("noisy", noisy), ("val", splits.val), ("test", splits.test)):
        table.to_csv(folder / f"{name}.csv", index=False)

    audit_cfg = TrainConfig(data=str(folder / "noisy.csv"), model=cfg.model, max_length=cfg.max_length)
    _, issues, summary = audit(audit_cfg)
    flagged, truth = set(issues["id"].astype(int)), set(flipped.tolist())
    hits = len(flagged & truth)
    first = set(issues["id"].astype(int)[: len(flipped)])  # as many of the ranked rows as were flipped
    found = {
        "flipped": len(flipped),
        "flagged": len(flagged),
        "precision": hits / max(len(flagged), 1),
        "recall": hits / max(len(flipped), 1),
        "precision_at_flipped": len(first & truth) / max(len(first), 1),
        "cross_validated_accuracy": summary["cross_validated_accuracy"],
        "seconds": round(summary["seconds"], 1),
    }
    print(
        f"audit: {len(flagged)} flagged of {len(clean)} ({len(flipped)} flipped): precision "
        f"{found['precision']:.3f}, recall {found['recall']:.3f}; the first {len(first)} ranked: precision "
        f"{found['precision_at_flipped']:.3f}; {found['seconds']:.0f} s"
    )
    # the data's own noise: what the audit flags where nothing was flipped (flags the precision above
    # counts as false, though some of them are wrong labels of the data as shipped)
    _, unflipped, _ = audit(dataclasses.replace(audit_cfg, data=str(folder / "clean.csv")))
    found["flagged_without_flips"] = len(unflipped)
    print(f"audit of the rows as shipped: {len(unflipped)} flagged of {len(clean)}")
    result = {
        "question": "does data audit find flipped labels, and does dropping them recover the accuracy lost?",
        "config": str(CONFIG.relative_to(CONFIG.parents[1])),
        "overrides": overrides,
        "noise": args.noise,
        "seed": args.seed,
        "train_examples": len(clean),
        "audit": found,
    }
    if not args.no_train:
        noisy[~noisy["id"].isin(flagged)].to_csv(folder / "cleaned.csv", index=False)
        val, test = str(folder / "val.csv"), str(folder / "test.csv")
        run_cfg = dataclasses.replace(cfg, val=val, test=test, baseline=False, max_train_examples=None)
        runs = {
            name: trained_accuracy(run_cfg, folder / f"{file}.csv", folder, name)
            for name, file in (("noisy", "noisy"), ("cleaned", "cleaned"), ("clean", "clean"))
        }
        lost = runs["clean"]["accuracy"] - runs["noisy"]["accuracy"]
        gained = runs["cleaned"]["accuracy"] - runs["noisy"]["accuracy"]
        result["training"] = runs
        result["recovered"] = gained / lost if lost > 0 else None
        result["audit_over_training_time"] = found["seconds"] / runs["noisy"]["seconds"]
        print(
            f"recovered {result['recovered']} of the accuracy lost; "
            f"the audit took {result['audit_over_training_time']:.2f}x a run's time"
        )
    write_result(args.out, result)


if __name__ == "__main__":
    main()
