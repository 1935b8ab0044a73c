"""How fast does the prompt scorer (`label_log_probs`: the prompt search and the baseline) read prompts on
this machine, by how the LM's decoder linears are stored and how many prompts a forward pass reads?

Baseline: the way before this script, fp32 linears (autocast casts each weight on every forward) in passes of
16 prompts. Candidates: the linears stored in the dtype autocast computes in (`lora.linears_as_computed`;
the same numbers, asserted), and passes of 32 or 64 prompts. Each task's first candidate prompt around 128
of its training texts; the ways take turns round by round in one process, the median round counts.

    python benchmarks/prompt_scoring.py [--tasks zh-reviews,en-tweets] [--texts 128] [--rounds 3]

On a CPU without bf16 (autocast off: fp32) the stored-as-computed ways are the baseline's and are skipped.
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import numpy as np
import torch
from common import RESULTS, write_result
from label_scoring import task_texts

from loracls.config import PromptConfig
from loracls.data.prompts import Prompter, candidate_prompts
from loracls.environment.devices import inference_autocast
from loracls.lora import linears_as_computed
from loracls.model import load_causal_lm, load_tokenizer, resolve_model
from loracls.objective import label_log_probs

WAYS = [("fp32 linears, 16 a pass", False, 16), ("stored as computed, 16", True, 16)]
WAYS += [
    ("fp32 linears, 32", False, 32),
    ("stored as computed, 32", True, 32),
    ("stored as computed, 64", True, 64),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", default="zh-reviews,en-tweets")
    parser.add_argument("--texts", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=RESULTS / "prompt_scoring.json")
    args = parser.parse_args()
    path = resolve_model("gemma3-270m")
    tokenizer = load_tokenizer(path)
    fp32 = load_causal_lm(path).eval()
    rows = []
    with inference_autocast(torch.device("cpu")):
        stored = copy.deepcopy(fp32)
        cast = linears_as_computed(stored, "cpu")
        computes = str(torch.get_autocast_dtype("cpu")).removeprefix("torch.") if cast else "float32"
        ways = [way for way in WAYS if cast or not way[1]]
        for task in args.tasks.split(","):
            texts, labels = task_texts(task, args.texts)
            prompt = candidate_prompts(labels, texts, PromptConfig())[0]
            prompter = Prompter(tokenizer, prompt, [], 128)
            tokens = prompter.label_tokens()
            columns = [tokens[label] for label in labels]
            prompts = prompter.encode(texts)
            for model in (fp32, stored):
                label_log_probs(model, tokenizer, prompts[:16], columns)  # warm up
            seconds: dict[str, list[float]] = {name: [] for name, _, _ in ways}
            scores = {}
            for _ in range(args.rounds):
                for name, as_computed, batch in ways:
                    started = time.perf_counter()
                    scores[name] = label_log_probs(
                        stored if as_computed else fp32, tokenizer, prompts, columns, batch_size=batch
                    )
                    seconds[name].append(time.perf_counter() - started)
            base = ways[0][0]
            for name, _, batch in ways:
                # storage alone gives the same numbers; another pass size pads the prompts to other widths,
                # which moves bf16 log-probabilities by up to ~0.15: the answers must stay (nearly) the same
                if batch == ways[0][2]:
                    np.testing.assert_array_equal(scores[name], scores[base])
                agree = float((scores[name].argmax(1) == scores[base].argmax(1)).mean())
                assert agree >= 0.97, f"{name}: {agree:.1%} of the answers agree with {base}'s"
                median = float(np.median(seconds[name]))
                row = {
                    "task": task,
                    "way": name,
                    "batch": batch,
                    "prompts": len(prompts),
                    "prompt_tokens_mean": round(float(np.mean([len(p) for p in prompts])), 1),
                    "seconds_median": round(median, 3),
                    "rounds_s": [round(s, 3) for s in seconds[name]],
                    "prompts_per_s": round(len(prompts) / median, 2),
                    "speed_vs_baseline": round(float(np.median(seconds[base])) / median, 3),
                    "max_abs_diff": round(float(np.abs(scores[name] - scores[base]).max()), 5),
                    "argmax_agreement": agree,
                }
                rows.append(row)
                print(
                    f"{task}: {name:24s} {row['prompts_per_s']:6.1f} prompts/s"
                    f"  {row['speed_vs_baseline']:.2f}x  max diff {row['max_abs_diff']}",
                    flush=True,
                )
    write_result(
        args.out,
        {
            "question": "the prompt scorer's speed by how the LM's linears are stored and prompts per pass",
            "baseline": WAYS[0][0],
            "autocast_computes": computes,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
