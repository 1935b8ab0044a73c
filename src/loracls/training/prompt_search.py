"""The prompt search: what scoring the candidate prompts costs (prompts, tokens) and what `prompt_budget`
cuts, the line that says so before it runs, the search itself (`choose_prompt`: each candidate's zero-shot
answers on a sample of training examples, with Cohen's kappa and its interval), how long the rest will take
once the first candidate is scored, and the short table of the best candidates after.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import pandas as pd
from rich.table import Table
from sklearn.metrics import cohen_kappa_score
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from loracls.config import PromptConfig, TrainConfig
from loracls.console import Stage, console, duration, progress
from loracls.data.labels import label_ids
from loracls.data.prompts import Prompt, Prompter, candidate_prompts, format_verbalizers
from loracls.data.splits import stratified_sample
from loracls.errors import LoraclsError
from loracls.objective import label_log_probs, later_tokens, objective_kind
from loracls.training.evaluate import score

PROMPT_KAPPA = 0.1
"""The agreement beyond chance (Cohen's kappa) of a prompt's zero-shot answers with the training sample's
labels above which `head_init: auto` starts the head from it. Measured: zh-reviews and en-tweets prompts of
Gemma 3 270M score about 0.15-0.3 and their heads learn faster than zero ones (benchmarks/README.md)."""


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
    first: int = 0
    """Texts of the sample that every group reads (the first round); the whole sample when there is one
    round."""
    kept: int = 0
    """Groups that read the rest of the sample too (the second round: the best of the first)."""

    def total(self, what: list) -> int:
        """Passes or tokens (`what`, per group) of the whole search: every group on the first round's texts,
        `kept` groups (at their mean) on the rest."""
        return round(search_reads(what, self.first, self.sample, self.kept))

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
FIRST_ROUND = 32
"""The search's first round: every candidate group reads this many texts of the sample (stratified, at least
`MIN_PER_LABEL` a label); only the best `KEPT_SHARE` of the groups (at least `KEPT_LEAST`) read the rest,
and the choice is made among those on the whole sample. `benchmarks/prompt_rounds.py` measured it against
every group on the whole sample (`results/prompt_rounds.json`)."""
KEPT_SHARE = 0.25
KEPT_LEAST = 2


def search_rounds(groups: int, sample: int, labels: int) -> tuple[int, int]:
    """(texts of the first round, groups kept for the rest) of a search of `groups` groups on `sample`
    texts: one round (every group on every text) where a first round would not be shorter or would leave
    no group out."""
    first = max(FIRST_ROUND, MIN_PER_LABEL * labels)
    kept = max(KEPT_LEAST, math.ceil(KEPT_SHARE * groups))
    if first >= sample or kept >= groups:
        return sample, groups
    return first, kept


def search_reads(cost: list, first: int, sample: int, kept: int) -> float:
    """What a search reads whose groups cost `cost` a text: every group `first` texts, `kept` groups (their
    mean cost) the remaining `sample - first`."""
    rest = (sample - first) * kept * float(np.mean(cost)) if cost and sample > first else 0.0
    return sum(cost) * first + rest


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
    # a stratified sample holds every label: at least `MIN_PER_LABEL` texts of each, where the data has them
    asked = 0 if train is None else min(max(cfg.prompt_sample, MIN_PER_LABEL * len(labels)), len(train))
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
    first, survivors = search_rounds(kept, sample, len(labels))
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
        first,
        survivors,
    )


def within_budget(cost: list[float], asked: int, labels: int, budget: int) -> tuple[int, int]:
    """(groups kept, sample) of a search whose groups cost `cost` (tokens) a text, in its rounds
    (`search_rounds`): all of them on `asked` texts where that fits `budget` (0: no limit); else the sample
    cut to fit, down to `MIN_PER_LABEL` texts per label, then the last groups dropped until it fits (the
    first is always scored)."""

    def reads(groups: int, sample: int) -> float:
        first, kept = search_rounds(groups, sample, labels)
        return search_reads(cost[:groups], first, sample, kept)

    if not budget or reads(len(cost), asked) <= budget:
        return len(cost), asked
    least = min(asked, MIN_PER_LABEL * labels)
    sample = asked
    while sample > least and reads(len(cost), sample) > budget:
        sample -= 1
    kept = len(cost)
    while kept > 1 and reads(kept, sample) > budget:
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


def prompt_table(prompt: Prompt, candidates: list[dict], sample: int, first: int = 0) -> Table | str:
    """The chosen prompt and the best few candidates' zero-shot scores on the training sample (`candidates`,
    `PromptChoice.candidates`; the chosen one among them, marked), those that read the whole sample first;
    prompt.json and the report hold all. `first`: the texts every candidate read (the first round)."""
    names = format_verbalizers({label: label for label in prompt.words})
    title = f"{prompt.name} ({short_words(format_verbalizers(prompt.words), names)})"
    if not candidates:
        return f"prompt: {title}"
    key = (prompt.name, format_verbalizers(prompt.words))
    chosen = next(r for r in candidates if (r["template"], r["verbalizers"]) == key)
    scored = [(n, r) for n, r in enumerate(candidates) if "macro_f1" in r]
    ranked = sorted(
        scored,
        key=lambda item: (-item[1].get("n", 0), -item[1]["macro_f1"], -item[1]["gold_log_prob"], item[0]),
    )
    shown = [r for _, r in ranked[:PROMPT_TABLE_ROWS]]
    if not any(r is chosen for r in shown):
        shown.append(chosen)
    table = Table(
        "", "template", "label words", "macro-F1", "accuracy", "kappa",
        title=f"prompt: chose {title} by zero-shot macro-F1 on {sample} training examples"
        + (f" (every candidate read {first} of them, the best few all)" if 0 < first < sample else "")
        + f"; the best {len(shown)} of {len(candidates)} candidates (all of them in prompt.json)",
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


def softmax(scores: np.ndarray) -> np.ndarray:
    """Probabilities over the labels from their log-probabilities (renormalised among the labels)."""
    z = np.exp(scores - scores.max(axis=1, keepdims=True))
    return z / z.sum(axis=1, keepdims=True)


def summary(table: pd.DataFrame, probs: np.ndarray, labels: list[str]) -> dict:
    metrics = score(table, probs, labels)
    return {key: metrics[key] for key in ("accuracy", "macro_f1", "weighted_f1", "pred_distribution", "n")}


@dataclass
class PromptChoice:
    """The prompt chosen on a sample of training examples, and every candidate's score there."""

    prompt: Prompt
    candidates: list[dict]
    """Per candidate: template name, verbalisers, accuracy, macro-F1 and predicted distribution on the
    sample (or why it was skipped); empty when there was nothing to choose."""
    sample: int
    """Training examples scored (0: no training examples)."""
    majority: float = 0.0
    """The most frequent label's share of the sample: what answering one label for every text scores."""
    first: int = 0
    """Texts of the sample that every candidate read (the search's first round); the candidates whose rows
    say `n` == `sample` read all of it."""

    def chosen(self) -> dict:
        """The chosen prompt's row of `candidates`."""
        key = (self.prompt.name, format_verbalizers(self.prompt.words))
        return next(r for r in self.candidates if (r["template"], r["verbalizers"]) == key)

    def informative(self) -> bool:
        """Whether the prompt knows something of the task: its zero-shot answers on the training sample agree
        with the labels beyond chance (Cohen's kappa at least `PROMPT_KAPPA`; 0 is what answers unrelated to
        the text score, whatever the label mix). A head started from a prompt that knows nothing starts
        confidently wrong: the label words' logits differ by several units on every text. A kappa whose 90%
        interval reaches 0 (`sureness`) is noise, however high: 0.125 from 32 examples once chose a head that
        knew nothing."""
        if not self.sample:
            return False
        row = self.chosen()
        return row["kappa"] >= PROMPT_KAPPA and kappa_interval(row)[0] > 0

    def informative_line(self) -> str:
        if not self.sample:
            return "no training examples to score the prompt on"
        row = self.chosen()
        return (
            f"the prompt's zero-shot answers on {self.sample} training examples: accuracy "
            f"{row['accuracy']:.3f} (majority label {self.majority:.3f}), Cohen's kappa {row['kappa']:.3f}"
            f"{sureness(row, self.sample)}; {PROMPT_KAPPA} needed, its interval above 0"
        )

    def to_json(self) -> dict:
        return {
            "chosen": self.prompt.name,
            "verbalizers": self.prompt.words,
            "sample": self.sample,
            "majority": self.majority,
            "first_round": self.first,
            "candidates": self.candidates,
        }


def kappa_standard_error(gold: np.ndarray, predicted: np.ndarray, classes: int) -> float:
    """The large-sample standard error of Cohen's kappa, sqrt(p_o (1 - p_o) / (n (1 - p_e)^2)) (Cohen 1960):
    how far another sample of as many texts could move it."""
    observed = float((gold == predicted).mean())
    chance = float(sum(np.mean(gold == c) * np.mean(predicted == c) for c in range(classes)))
    if chance >= 1.0:
        return 0.0
    return float(np.sqrt(observed * (1 - observed) / (len(gold) * (1 - chance) ** 2)))


def kappa_interval(row: dict) -> tuple[float, float]:
    """A candidate's kappa's 90% interval (the kappa at both ends where no standard error is stored)."""
    spread = 1.645 * row.get("kappa_se", 0.0)
    return row["kappa"] - spread, row["kappa"] + spread


def sureness(row: dict, sample: int) -> str:
    """How sure a candidate's kappa is, in words: its 90% interval from the sample (none where not stored)."""
    if "kappa_se" not in row:
        return ""
    low, high = kappa_interval(row)
    noise = "; within noise of chance" if low <= 0 else ""
    return f" (90% interval {low:.2f} to {high:.2f} from {sample} examples{noise})"


def choose_prompt(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    train: pd.DataFrame | None,
    labels: list[str],
    cfg: PromptConfig,
    plan: SearchPlan | None = None,
) -> PromptChoice:
    """The candidate prompt (`plan_search`) whose uncalibrated zero-shot answers score the best macro-F1 on a
    stratified sample of `cfg.prompt_sample` training examples (fewer over `cfg.prompt_budget`; ties: the
    higher mean log-probability of the right label, then the earlier candidate). Never sees validation or
    test labels. Shows its progress, and once the first candidate is scored how long the rest will take.

    Uncalibrated, because that is what a verbaliser-initialised head answers at step 0; macro-F1, because a
    prompt that gives every text one label (listing the options, a small model copies the first) scores low
    on it.
    """
    plan = plan or plan_search(tokenizer, train, labels, cfg)
    candidates, rows = plan.candidates, [dict(row) for row in plan.rows]
    if train is None or train.empty:
        return PromptChoice(candidates[0], [], 0)
    sample = stratified_sample(train, plan.sample, cfg.seed)
    first = stratified_sample(sample, plan.first, cfg.seed)
    sample = pd.concat([first, sample.drop(first.index)])  # the first round's texts first
    label2id = label_ids(labels)
    gold = np.array([label2id[x] for x in sample["label"]])
    chat = bool(cfg.chat_template)
    read: dict[int, np.ndarray] = {}  # group -> its scores on the texts it has read so far
    keys: dict[int, tuple[float, float]] = {}  # candidate -> (macro-F1, gold log-prob) there

    def score_groups(groups: list[int], texts: pd.DataFrame, stage: Stage) -> None:
        for g in groups:
            group = plan.groups[g]
            one, last = group[0][0] + 1, group[-1][0] + 1
            which = f"candidate {one}" if one == last else f"candidates {one}-{last}"
            stage.update(at=f"{which} of {len(candidates)}")
            # candidates whose prompts are the same text are scored in one pass: every word set's tokens are
            # read from the same forward passes
            prompts = Prompter(tokenizer, candidates[one - 1], [], cfg.max_length, chat=chat).encode(
                list(texts["text"])
            )
            columns = [tokens[label] for _, tokens in group for label in labels]
            every = label_log_probs(model, tokenizer, prompts, columns, advance=stage.advance)
            read[g] = every if g not in read else np.concatenate([read[g], every])
            for k, (n, _) in enumerate(group):
                probs = softmax(read[g][:, k * len(labels) : (k + 1) * len(labels)])
                figures, keys[n] = rate(probs, sample, gold, labels)
                rows[n] |= figures
            if g == 0 and len(read[g]) == plan.first and len(plan.groups) > 1:
                eta_line(stage, which)

    with progress("prompt search", plan.total(plan.passes), "prompts") as stage:
        score_groups(list(range(len(plan.groups))), sample.iloc[: plan.first], stage)
        best_of = [max(keys[n] for n, _ in group) for group in plan.groups]
        kept = sorted(range(len(plan.groups)), key=lambda g: best_of[g], reverse=True)[: plan.kept]
        if plan.first < len(sample):  # one round: every group has read the whole sample already
            score_groups(sorted(kept), sample.iloc[plan.first :], stage)
    scored = [(keys[n], n) for g in kept for n, _ in plan.groups[g]]
    if not scored:
        reasons = sorted({r["skipped"] for r in rows})
        raise LoraclsError(
            f"No candidate prompt can score the labels {labels}: {'; '.join(reasons)}. Give label words that "
            "differ from the first token on with --verbalizers label=word,..."
        )
    best = candidates[max(sorted(scored, key=lambda item: item[1]), key=lambda item: item[0])[1]]
    majority = float(sample["label"].value_counts(normalize=True).max())
    return PromptChoice(best, rows, len(sample), majority, plan.first)


def rate(
    probs: np.ndarray, sample: pd.DataFrame, gold: np.ndarray, labels: list[str]
) -> tuple[dict, tuple[float, float]]:
    """A candidate's zero-shot figures on the first `len(probs)` texts of the sample (accuracy, macro-F1,
    kappa with its standard error, the mean log-probability of the right label), and the key the search
    ranks it by: (macro-F1, that log-probability unrounded)."""
    n = len(probs)
    gold, predicted = gold[:n], probs.argmax(1)
    kappa = cohen_kappa_score(gold, predicted, labels=list(range(len(labels))))
    gold_log_prob = float(np.log(probs[np.arange(n), gold]).mean())
    figures = {
        **summary(sample.iloc[:n], probs, labels),
        "kappa": round(float(np.nan_to_num(kappa)), 4),
        "kappa_se": round(kappa_standard_error(gold, predicted, len(labels)), 4),
        "gold_log_prob": round(gold_log_prob, 4),
    }
    return figures, (figures["macro_f1"], gold_log_prob)
