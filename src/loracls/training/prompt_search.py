"""The prompt search's plan and report: what scoring the candidate prompts costs (prompts, tokens)
and what `prompt_budget` cuts, the line that says so before it runs, how long the rest will take once the
first candidate is scored, and the short table of the best candidates after. `baseline.choose_prompt` runs
the search.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from rich.table import Table
from transformers import PreTrainedTokenizerBase

from loracls.config import PromptConfig, TrainConfig
from loracls.console import Stage, console, duration
from loracls.data.prompts import Prompt, Prompter, candidate_prompts, format_verbalizers
from loracls.data.splits import stratified_sample
from loracls.errors import LoraclsError
from loracls.objective import later_tokens, objective_kind


@dataclass
class SearchPlan:
    """What the prompt search scores, decided before it runs: the candidates (each one's row, with why it is
    not scored), the candidates whose prompts are the same text (word sets of a template that lists no
    options: scored in one pass), what each group costs a text, the sample asked for and the sample scored
    (smaller where `prompt_budget` cut it)."""

    candidates: list[Prompt]
    rows: list[dict]
    groups: list[list[tuple[int, dict[str, list[int]]]]]
    """Per group scored: (candidate, its label tokens), in candidate order."""
    passes: list[int]
    """Per group, the prompts a text costs: 1 (`label_log_probs` reads a prompt in one pass, whatever the
    labels; the words' later tokens ride on its cache)."""
    tokens: list[float]
    """Per group, the tokens a text costs, on average over the sample asked for: its prompt and the label
    words' later tokens (`later_tokens`)."""
    asked: int
    sample: int
    budget: int
    unscored: int
    """Candidates left out to fit `budget`."""

    def total(self, what: list) -> int:
        """Passes or tokens (`what`) of the whole search."""
        return round(sum(what) * self.sample)

    def scored(self) -> int:
        return sum(len(group) for group in self.groups)

    def cut(self) -> str:
        """What `prompt_budget` left out, in words ("" when nothing)."""
        if self.sample == self.asked and not self.unscored:
            return ""
        parts = [f"{self.sample} of {self.asked} examples"] if self.sample < self.asked else []
        parts += [f"{self.unscored} candidates left unscored"] if self.unscored else []
        return f"{' and '.join(parts)} to fit --prompt-budget {self.budget:,} tokens"


UNSCORED = "not scored: over --prompt-budget"
MIN_PER_LABEL = 2
"""The fewest training examples per label that `prompt_budget` cuts the search's sample down to."""


def plan_search(
    tokenizer: PreTrainedTokenizerBase, train: pd.DataFrame | None, labels: list[str], cfg: PromptConfig
) -> SearchPlan:
    """The candidates (`candidate_prompts`) and what scoring them costs, measured on the sample asked for; a
    candidate whose label words the tokenizer cannot read is skipped, with why. Over `cfg.prompt_budget`,
    `within_budget` cuts it."""
    candidates = candidate_prompts(labels, [] if train is None else list(train["text"]), cfg)
    rows = [{"template": p.name, "verbalizers": format_verbalizers(p.words)} for p in candidates]
    groups: dict[str, list[tuple[int, dict[str, list[int]]]]] = {}  # rendered prompt -> candidates
    for n, prompt in enumerate(candidates):
        try:
            tokens = Prompter(
                tokenizer, prompt, [], cfg.max_length, chat=bool(cfg.chat_template)
            ).label_tokens()
        except LoraclsError as e:
            rows[n]["skipped"] = str(e)
            continue
        groups.setdefault(prompt.render("\0"), []).append((n, tokens))
    scored = list(groups.values())
    asked = 0 if train is None else min(cfg.prompt_sample, len(train))
    texts = [] if train is None else list(stratified_sample(train, asked, cfg.seed)["text"])
    passes, reads = [], []
    for group in scored:
        prompter = Prompter(
            tokenizer, candidates[group[0][0]], [], cfg.max_length, chat=bool(cfg.chat_template)
        )
        length = float(np.mean([len(ids) for ids in prompter.encode(texts)])) if texts else 0.0
        passes.append(1)
        reads.append(length + later_tokens([t[label] for _, t in group for label in labels]))
    kept, sample = within_budget(reads, asked, len(labels), cfg.prompt_budget)
    for group in scored[kept:]:
        for n, _ in group:
            rows[n]["skipped"] = UNSCORED
    unscored = sum(len(group) for group in scored[kept:])
    return SearchPlan(
        candidates,
        rows,
        scored[:kept],
        passes[:kept],
        reads[:kept],
        asked,
        sample,
        cfg.prompt_budget,
        unscored,
    )


def within_budget(cost: list[float], asked: int, labels: int, budget: int) -> tuple[int, int]:
    """(groups kept, sample) of a search whose groups cost `cost` (tokens) a text: all of them on `asked`
    texts where that fits `budget` (0: no limit); else the sample cut to fit, down to `MIN_PER_LABEL` texts
    per label, then the last groups dropped until it fits (the first is always scored)."""
    if not budget or sum(cost) * asked <= budget:
        return len(cost), asked
    sample = max(min(asked, MIN_PER_LABEL * labels), int(budget // sum(cost)))
    kept = len(cost)
    while kept > 1 and sum(cost[:kept]) * sample > budget:
        kept -= 1
    return kept, sample


def search_line(plan: SearchPlan, cfg: TrainConfig, wants_baseline: bool) -> str:
    """Before the prompt search: how much it scores (and what `prompt_budget` cut), why it runs at all, and
    the options that skip it."""
    reason = objective_kind(cfg.objective).why_prompt(cfg)
    why = [reason] if reason else []
    if wants_baseline:
        why.append("the prompt baseline (--no-baseline)")
    count = plan.scored()
    what = f"{count} candidate prompts" if count > 1 else "the prompt"
    cut = plan.cut()
    return (
        f"prompt: scoring {what} on {plan.sample} training examples ({plan.total(plan.passes):,} prompts, "
        f"{plan.total(plan.tokens):,} tokens"
        + (f"; cut to {cut}" if cut else "")
        + f"), for {' and '.join(why)}"
    )


ETA_LINE_S = 10.0
"""The prompt search says how long it will take, once its first candidate is scored, when that is longer."""


def eta_line(stage: Stage, first: str) -> None:
    """After the search's first candidate(s): how long they took and the rest will, when that is long."""
    left = stage.seconds_left()
    if left is not None and left >= ETA_LINE_S:
        took = duration(time.monotonic() - stage.started)
        console.print(f"prompt: {first} took {took}; about {duration(left)} for the rest", soft_wrap=True)


PROMPT_TABLE_ROWS = 5
"""The candidates the prompt table shows: the best few by macro-F1 (prompt.json and the report hold all)."""


def prompt_table(prompt: Prompt, candidates: list[dict], sample: int) -> Table | str:
    """The chosen prompt and the best few candidates' zero-shot scores on the training sample (`candidates`,
    `PromptChoice.candidates`; the chosen one among them, marked); prompt.json and the report hold all."""
    names = format_verbalizers({label: label for label in prompt.words})
    title = f"{prompt.name} ({short_words(format_verbalizers(prompt.words), names)})"
    if not candidates:
        return f"prompt: {title}"
    key = (prompt.name, format_verbalizers(prompt.words))
    chosen = next(r for r in candidates if (r["template"], r["verbalizers"]) == key)
    scored = [(n, r) for n, r in enumerate(candidates) if "macro_f1" in r]
    ranked = sorted(scored, key=lambda item: (-item[1]["macro_f1"], -item[1]["gold_log_prob"], item[0]))
    shown = [r for _, r in ranked[:PROMPT_TABLE_ROWS]]
    if not any(r is chosen for r in shown):
        shown.append(chosen)
    table = Table(
        "", "template", "label words", "macro-F1", "accuracy", "kappa",
        title=f"prompt: chose {title} by zero-shot macro-F1 on {sample} training examples; the best "
        f"{len(shown)} of {len(candidates)} candidates (all of them in prompt.json)",
        title_justify="left",
    )  # fmt: skip
    for row in shown:
        table.add_row(
            "chosen" if row is chosen else "",
            row["template"],
            short_words(row["verbalizers"], names),
            f"{row['macro_f1']:.3f}",
            f"{row['accuracy']:.3f}",
            f"{row['kappa']:.3f}",
        )
    return table


def short_words(words: str, names: str, width: int = 40) -> str:
    """Label words (`format_verbalizers`) for a line: `the label names` where they are `names` (each label
    its own word), else cut to `width` characters."""
    if words == names:
        return "the label names"
    return words if len(words) <= width else words[: width - 1] + "…"
