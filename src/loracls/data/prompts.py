"""Prompts: the built-in templates and label words, how a config resolves them, and how a text becomes a
prompt's tokens. The baseline scores them; a verbaliser-initialised classifier reads every text through one.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pandas as pd
import yaml
from transformers import PreTrainedTokenizerBase

from loracls.config import PromptConfig
from loracls.errors import LoraclsError


@dataclass
class Template:
    """A prompt: the instruction, each shot as `example` + `separator` + verbaliser, then the query."""

    instruction: str
    example: str
    separator: str

    def render(self, text: str, options: list[str], shots: list[tuple[str, str]]) -> str:
        parts = [self.instruction.format(options=", ".join(options))] if self.instruction else []
        parts += [self.example.format(text=t) + self.separator + word for t, word in shots]
        parts.append(self.example.format(text=text))
        return "\n\n".join(parts)


TEMPLATES = {
    "en-options": Template(
        "Classify the text. Answer with one of: {options}.", "Text: {text}\nAnswer:", separator=" "
    ),
    "en-label": Template("", "Text: {text}\nLabel:", separator=" "),
    "en-sentiment": Template("", "Text: {text}\nSentiment:", separator=" "),
    "en-it-was": Template("", "{text}\nIt was", separator=" "),
    "en-review": Template("", "Review: {text}\nThis review is", separator=" "),
    "zh-options": Template(
        "判断下面文本的类别，只回答其中之一：{options}。", "文本：{text}\n回答：", separator=""
    ),
    "zh-label": Template("", "文本：{text}\n类别：", separator=""),
    "zh-sentiment": Template("", "评论：{text}\n情感：", separator=""),
    "zh-overall": Template("", "{text}\n总体评价：", separator=""),
    "zh-review": Template("", "评论：{text}\n这是一条", separator=""),
}
"""The built-in prompts by name, `<language>-<style>`: one listing the options (the first is the default
where no training data can choose), the others answering straight after the text (LM-BFF's `It was`)."""

WORD_SETS = {
    "en": [
        {},
        {"positive": "great", "negative": "terrible", "neutral": "okay"},
        {"positive": "good", "negative": "bad", "neutral": "neutral"},
    ],
    "zh": [
        {"positive": "正面", "negative": "负面", "neutral": "中性"},
        {"positive": "好", "negative": "差", "neutral": "一般"},
        {"positive": "积极", "negative": "消极", "neutral": "中性"},
        {"positive": "好评", "negative": "差评", "neutral": "中评"},
    ],
}
"""Label-word candidates per language; a label a set does not name is its own word. Sets that rename a
label only apply when they name every label (a sentiment task); the first set always applies. Other tasks
get their label names made readable as a second set (`readable_words`)."""


ENGLISH_WORDS = (
    "the an and or but of to on for with at by from is are was were be been it this that these those i you "
    "she we they my your our their him them not does did have has had can will would what how why when "
    "where which who there here just very"
)
"""Common English words that other Latin-script languages do not share (no `a`, `no`, `he`, `in`, `me`): in
English text 15% or more of the words (en-tweets, 20 tweets at a time; BANKING77's queries about 40%); in
Spanish, French or German sentences almost none."""

SCRIPTS = {
    "zh": "Chinese",
    "ja": "Japanese (kana)",
    "ko": "Korean (Hangul)",
    "ru": "Cyrillic-script",
    "latin": "Latin-script but not English",
    "en": "English",
}
"""What `text_language` tells apart, by name; loracls has templates for `en` and `zh` (`TEMPLATES`)."""


def text_language(texts: list[str]) -> str:
    """The language (or script) of a sample of texts, a key of `SCRIPTS`: kana makes it Japanese, Hangul
    Korean, CJK ideographs over a fifth of the letters Chinese, Cyrillic over half Russian-like; Latin-script
    text is English when common English words are over 12% of its words, else `latin`."""
    sample = " ".join(texts[:200])
    letters = [c for c in sample if c.isalpha()]
    if not letters:
        return "en"

    def share(low: str, high: str) -> float:
        return sum(1 for c in letters if low <= c <= high) / len(letters)

    if share("\u3040", "\u30ff") > 0.05:
        return "ja"
    if share("\uac00", "\ud7af") + share("\u1100", "\u11ff") > 0.2:
        return "ko"
    if share("\u4e00", "\u9fff") > 0.2:
        return "zh"
    if share("\u0400", "\u04ff") > 0.5:
        return "ru"
    words = re.findall(r"[^\W\d_]+", sample.lower())
    common = set(ENGLISH_WORDS.split())
    english = sum(1 for w in words if w in common) / max(len(words), 1)
    return "en" if english > 0.12 else "latin"


def detect_language(texts: list[str]) -> str:
    """The language of the templates for these texts: `zh` for Chinese, else `en` (the only other one
    loracls has; `language_note` says so)."""
    return "zh" if text_language(texts) == "zh" else "en"


def language_note(texts: list[str]) -> str | None:
    """For texts in a language loracls has no template for: what it uses instead."""
    language = text_language(texts)
    if language in ("en", "zh"):
        return None
    return (
        f"the texts look {SCRIPTS[language]}; loracls has English and Chinese prompt templates only, so the "
        "English ones are used (--template and --instruction write your own)"
    )


def readable_words(labels: list[str]) -> dict[str, str] | None:
    """Label names as words a language model reads: `AddToPlaylist` -> `add to playlist`, `card_arrival` ->
    `card arrival`, a prefix every label shares dropped (`route_xx_refund` -> `refund`). None when that
    changes nothing, or would make two labels one word or a label empty."""
    split = []
    for name in labels:
        spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])", " ", name)
        split.append(re.sub(r"[_\-./:]+", " ", spaced).lower().split())
    while len(split) > 1 and all(len(words) > 1 and words[0] == split[0][0] for words in split):
        split = [words[1:] for words in split]
    words = {name: " ".join(parts) for name, parts in zip(labels, split, strict=True)}
    if any(not w for w in words.values()) or len(set(words.values())) < len(labels):
        return None
    return None if all(w == name for name, w in words.items()) else words


def parse_verbalizers(spec: str | dict[str, str] | None, labels: list[str]) -> dict[str, str] | None:
    """{label: word} from a mapping, or from `positive=good,negative=bad` (what the command line and
    config.yaml of earlier versions give); every label needs one."""
    if not spec:
        return None
    if isinstance(spec, dict):
        pairs = {str(label): str(word) for label, word in spec.items()}
    else:
        pairs = dict(item.split("=", 1) for item in spec.split(",") if "=" in item)
    missing = [label for label in labels if label not in pairs]
    if missing or not pairs:
        raise LoraclsError(
            f"verbalizers {spec!r} must give a word for every label (label=word,... or, for labels with `,` "
            f"or `=`, a YAML mapping in --config); missing: {missing}"
        )
    return {label: pairs[label] for label in labels}


def read_descriptions(spec: str | dict[str, str] | None, labels: list[str]) -> dict[str, str] | None:
    """{label: description} from a mapping or a file (`TrainConfig.label_descriptions`): YAML or JSON
    holding a mapping, or a CSV/TSV with the columns `label` and `description`. Every label needs a
    description that is not empty, and a label the data does not have is refused (a typo would go unseen)."""
    if not spec:
        return None
    where = "label_descriptions"
    if isinstance(spec, dict):
        pairs = {str(label): str(text) for label, text in spec.items()}
    else:
        path = Path(spec)
        where = str(path)
        if not path.is_file():
            raise LoraclsError(f"label descriptions: {path} is not a file")
        if path.suffix.lower() in (".csv", ".tsv"):
            table = pd.read_csv(path, sep="\t" if path.suffix.lower() == ".tsv" else ",", dtype=str)
            if not {"label", "description"} <= set(table.columns):
                raise LoraclsError(f"{path}: needs the columns `label` and `description`, has {list(table)}")
            pairs = dict(zip(table["label"], table["description"].fillna(""), strict=True))
        else:
            try:
                loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
            except yaml.YAMLError as e:
                raise LoraclsError(f"{path}: not YAML or JSON ({e})") from e
            if not isinstance(loaded, dict):
                raise LoraclsError(f"{path}: must map each label to its description")
            pairs = {str(label): "" if text is None else str(text) for label, text in loaded.items()}
    missing = [label for label in labels if not pairs.get(label, "").strip()]
    unknown = [label for label in pairs if label not in labels]
    if missing or unknown:
        raise LoraclsError(
            f"{where}: every label needs a description, and only the data's labels {labels}; "
            f"missing or empty: {missing}; not a label of the data: {unknown}"
        )
    return {label: " ".join(pairs[label].split()) for label in labels}


def parse_label_order(spec: str | list[str] | None, labels: list[str]) -> list[str]:
    """The labels in the order a prompt lists them: a list, or comma-separated; default `labels`."""
    if not spec:
        return labels
    order = [str(x) for x in spec] if isinstance(spec, list) else [x.strip() for x in spec.split(",")]
    if sorted(order) != sorted(labels):
        raise LoraclsError(
            f"label_order {order} must list each of the labels {labels} once (comma-separated, or for "
            "labels with `,` a YAML list in --config)"
        )
    return order


def format_verbalizers(words: dict[str, str]) -> str:
    """{label: word} as one line, `label=word,...`, for messages and the candidates' table."""
    return ",".join(f"{label}={word}" for label, word in words.items())


@dataclass
class Prompt:
    """A resolved prompt: the template (and its name), each label's word, and the order options are listed."""

    name: str
    template: Template
    words: dict[str, str]
    order: list[str]

    def render(self, text: str, shots: list[tuple[str, str]] = (), order: list[str] | None = None) -> str:
        """The prompt for `text` after `shots` ((text, label) pairs), options listed in `order`."""
        options = [self.words[label] for label in order or self.order]
        return self.template.render(text, options, [(t, self.words[label]) for t, label in shots])

    def to_json(self) -> dict:
        """What a run and an export record; `prefix + text + suffix` is the classifier's input."""
        prefix, _, suffix = self.render("\0").partition("\0")
        return {
            "name": self.name,
            **asdict(self.template),
            "verbalizers": self.words,
            "label_order": self.order,
            "prefix": prefix,
            "suffix": suffix,
        }

    @classmethod
    def from_json(cls, value: dict) -> Prompt:
        template = Template(value["instruction"], value["example"], value["separator"])
        return cls(value["name"], template, dict(value["verbalizers"]), list(value["label_order"]))


def candidate_prompts(labels: list[str], texts: list[str], prompt: PromptConfig) -> list[Prompt]:
    """The prompts `prompt` allows: its named template, or (`auto`) every built-in one of the texts'
    language, each with every label-word set that fits (the `label_descriptions` among them), unless
    `verbalizers`/`prompt_template`/`prompt_instruction` fix them. The first is the default when nothing
    chooses."""
    order = parse_label_order(prompt.label_order, labels)
    language = detect_language(texts)
    if prompt.prompt != "auto":
        if prompt.prompt not in TEMPLATES:
            raise LoraclsError(f"prompt {prompt.prompt!r} is not one of: auto, {', '.join(TEMPLATES)}")
        language = prompt.prompt.split("-")[0]
        names = [prompt.prompt]
    else:
        names = [name for name in TEMPLATES if name.startswith(language + "-")]
    if prompt.prompt_template is not None or prompt.prompt_instruction is not None:
        names = names[:1]  # an own template or instruction: nothing to choose between
    word_sets = [
        {label: words.get(label, label) for label in labels}
        for n, words in enumerate(WORD_SETS[language])
        if n == 0 or set(labels) <= set(words)
    ]
    readable = readable_words(labels)
    if readable and len(word_sets) == 1:  # not a sentiment task: the names as words, beside the names
        word_sets.append(readable)
    described = read_descriptions(prompt.label_descriptions, labels)
    if described:
        word_sets.append(described)
    fixed = parse_verbalizers(prompt.verbalizers, labels)
    if fixed:
        word_sets = [fixed]
    candidates = []
    for name in names:
        template = TEMPLATES[name]
        if prompt.prompt_template is not None:
            if "{text}" not in prompt.prompt_template:
                raise LoraclsError(f"prompt template {prompt.prompt_template!r} has no {{text}} placeholder")
            template = Template(template.instruction, prompt.prompt_template, template.separator)
        if prompt.prompt_instruction is not None:
            template = Template(prompt.prompt_instruction, template.example, template.separator)
        candidates += [Prompt(name, template, words, order) for words in word_sets]
    return candidates


def resolve_prompt(labels: list[str], texts: list[str], prompt: PromptConfig) -> Prompt:
    """The prompt `prompt` names, defaults filled in from the texts' language (`auto`: the language's first
    template and word set; `choose_prompt` picks among all of them where training data exists)."""
    return candidate_prompts(labels, texts, prompt)[0]


def pin_prompt(cfg: PromptConfig, chosen: Prompt) -> None:
    """Write `chosen` into `cfg`'s prompt keys, so that `resolve_prompt(labels, [], cfg)` gives it again
    (what a run's config.yaml stores, and eval/predict/export read)."""
    cfg.prompt = chosen.name
    cfg.verbalizers = dict(chosen.words)  # a mapping and a list: any string is a label
    cfg.label_order = list(chosen.order)


def verbalizer_tokens(tokenizer: PreTrainedTokenizerBase, prompt: Prompt) -> dict[str, list[int]]:
    """Each label's verbaliser as the tokens that follow the prompt (tokenised in context, not alone).

    "positive" after "Answer: " is not the same tokens as "positive" at the start of a string; the tokens
    are taken as the difference between the prompt's end with and without the verbaliser.
    """
    template = prompt.template
    tail = template.example.format(text="x")
    base = tokenizer(tail, add_special_tokens=False)["input_ids"]
    tokens = {}
    for label, word in prompt.words.items():
        full = tokenizer(tail + template.separator + word, add_special_tokens=False)["input_ids"]
        if full[: len(base)] != base or len(full) == len(base):
            full = base + tokenizer(template.separator + word, add_special_tokens=False)["input_ids"]
        tokens[label] = full[len(base) :]
        if not tokens[label]:
            raise LoraclsError(f"verbaliser {word!r} of label {label!r} is empty after tokenisation")
    seen: dict[tuple[int, ...], str] = {}
    for label, ids in tokens.items():
        if tuple(ids) in seen:
            raise LoraclsError(f"labels {seen[tuple(ids)]!r} and {label!r} have the same verbaliser tokens")
        seen[tuple(ids)] = label
    return tokens


def answer_tokens(
    tokenizer: PreTrainedTokenizerBase, prompt: Prompt, labels: list[str]
) -> tuple[list[int], list[list[int]]]:
    """(the tokens every label's verbaliser starts with, each label's tokens after them, in label order): a
    classifier initialised from the LM head reads the prompt followed by the shared tokens (usually none;
    a tokenizer that splits off the separator's space gives one), and starts each label's row from the
    tokens that follow (`objective.label_rows`)."""
    tokens = [verbalizer_tokens(tokenizer, prompt)[label] for label in labels]
    shared = 0
    while all(len(t) > shared + 1 and t[shared] == tokens[0][shared] for t in tokens):
        shared += 1
    return tokens[0][:shared], [t[shared:] for t in tokens]


def part_on_first_token(following: list[list[int]]) -> bool:
    """Whether each label's word, after the start the words share (`answer_tokens`), begins with a token no
    other label's word begins with."""
    first = [ids[0] for ids in following]
    return len(set(first)) == len(first)


def special_tokens_around(tokenizer: PreTrainedTokenizerBase) -> tuple[list[int], list[int]]:
    """The special tokens `tokenizer` adds before and after a text's own (Gemma and Llama a `<bos>` before,
    Qwen none)."""
    own = tokenizer("x", add_special_tokens=False)["input_ids"]
    full = tokenizer("x")["input_ids"]
    for start in range(len(full) - len(own) + 1):
        if full[start : start + len(own)] == own:
            return full[:start], full[start + len(own) :]
    raise LoraclsError(f"{type(tokenizer).__name__} changes a text's own tokens when it adds special tokens")


@dataclass
class Prompter:
    """Turns texts into prompt token ids, with the prompt and the shots fixed."""

    tokenizer: PreTrainedTokenizerBase
    prompt: Prompt
    shots: list[tuple[str, str]]
    """(text, label) pairs shown before the query."""
    max_length: int
    answer_start: list[int] = field(default_factory=list)
    """Token ids appended after each prompt: the start every label's verbaliser shares (`answer_tokens`)."""
    chat: bool = False
    """The prompt is the user's turn of the tokenizer's chat template, the answer starts the model's turn."""
    pieces: bool = True
    """The prompt's prefix, the text and its suffix are tokenised apart and joined as ids (`around`), as an
    export's tokenizer adds the prompt to any text (`inference.export.prompt_in_tokenizer`); False: the
    joined string is tokenised, as exports without `prefix_ids` in their prompt read texts."""
    fixed: tuple[list[int], list[int]] | None = None
    """The ids before and after every text's own, as an export recorded them (None: from the prompt)."""

    def render(self, text: str, order: list[str] | None = None) -> str:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > self.max_length:  # cut the text, never the prompt around it
            text = self.tokenizer.decode(ids[: self.max_length])
        rendered = self.prompt.render(text, self.shots, order)
        if self.chat:
            return self.tokenizer.apply_chat_template(
                [{"role": "user", "content": rendered}], tokenize=False, add_generation_prompt=True
            )
        return rendered

    def lists_labels(self, order: list[str]) -> bool:
        """Whether the prompt lists the labels, so that reversing `order` changes it (the baseline's bias
        check reads the texts again only then)."""
        return self.render("\0", order) != self.render("\0", order[::-1])

    def to_json(self) -> dict:
        """The prompt as an export records it: the model reads `prefix + text + suffix`, tokenised (with the
        tokenizer's special tokens unless `chat`: the chat template writes its own), then `answer_start`
        (token ids; usually none)."""
        prefix, _, suffix = self.render("\0").partition("\0")
        value = {**self.prompt.to_json(), "answer_start": self.answer_start, "chat": self.chat}
        value |= {"prefix": prefix, "suffix": suffix}
        if self.pieces:
            before, after = self.around()
            value |= {"prefix_ids": before, "suffix_ids": after}
        return value

    @classmethod
    def from_json(cls, tokenizer: PreTrainedTokenizerBase, value: dict, max_length: int) -> Prompter:
        """The prompter an export recorded; one with `prefix_ids` reads texts between those ids."""
        prompt = Prompt.from_json(value)
        pieces = "prefix_ids" in value
        return cls(
            tokenizer,
            prompt,
            [],
            max_length,
            list(value.get("answer_start", [])),
            value.get("chat", False),
            pieces,
            (list(value["prefix_ids"]), list(value["suffix_ids"])) if pieces else None,
        )

    def around(self, order: list[str] | None = None) -> tuple[list[int], list[int]]:
        """The token ids before each text's own (the tokenizer's leading special tokens unless `chat`: its
        template writes them; the prompt's prefix) and after it (the suffix, trailing special tokens, then
        `answer_start`)."""
        if self.fixed is not None and order is None:
            return self.fixed
        prefix, _, suffix = self.render("\0", order).partition("\0")
        before, after = ([], []) if self.chat else special_tokens_around(self.tokenizer)
        return before + self.piece(prefix), self.piece(suffix) + after + self.answer_start

    def piece(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"] if text else []

    def encode(self, texts: list[str], order: list[str] | None = None) -> list[list[int]]:
        """Each text's ids inside the prompt, the text cut to `max_length` tokens (never the prompt)."""
        if not self.pieces:
            return [
                self.tokenizer(self.render(text, order), add_special_tokens=not self.chat)["input_ids"]
                + self.answer_start
                for text in texts
            ]
        before, after = self.around(order)
        own = self.tokenizer(list(texts), add_special_tokens=False)["input_ids"] if len(texts) else []
        return [before + ids[: self.max_length] + after for ids in own]

    def label_tokens(self) -> dict[str, list[int]]:
        """Each label's word as the tokens that follow the prompt (`verbalizer_tokens`; in a chat, the start
        of the model's turn)."""
        if not self.chat:
            return verbalizer_tokens(self.tokenizer, self.prompt)
        tokens = {
            label: self.tokenizer(word, add_special_tokens=False)["input_ids"]
            for label, word in self.prompt.words.items()
        }
        if len({tuple(t) for t in tokens.values()}) < len(tokens) or not all(tokens.values()):
            raise LoraclsError(
                f"the label words {self.prompt.words} are empty or the same after tokenisation"
            )
        return tokens

    def encode_responses(
        self, texts: list[str], labels: list[str], comments: list[str] | None = None
    ) -> tuple[list[list[int]], list[int]]:
        """Training sequences of an `objective: lm` run and where each response starts: the prompt, the
        label's words, with a comment a new line and the comment (cut to `max_length` tokens), then the
        end-of-sequence token."""
        words = self.label_tokens()
        sequences, starts = [], []
        for n, (ids, label) in enumerate(zip(self.encode(texts), labels, strict=True)):
            response = list(words[label])
            if comments is not None and comments[n]:
                extra = self.tokenizer("\n" + comments[n], add_special_tokens=False)["input_ids"]
                response += extra[: self.max_length]
            sequences.append(ids + response + [self.tokenizer.eos_token_id])
            starts.append(len(ids))
        return sequences, starts
