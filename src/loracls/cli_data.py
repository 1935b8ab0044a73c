"""`loracls data`: look at a dataset before training: its sizes, labels and lengths (`inspect`), and the
labels that are probably wrong (`audit`); and `loracls select`: the unlabelled texts to label next."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from loracls.cli_options import UNFINISHED, HelpCommand, fail, quiet_libraries
from loracls.config import TrainConfig
from loracls.errors import LoraclsError

console = Console()

data_app = typer.Typer(
    help="Look at a dataset before training: inspect it, audit its labels.",
    no_args_is_help=True,
    rich_markup_mode=None,
)


@data_app.command("inspect", cls=HelpCommand)
def data_inspect(
    data: Annotated[str, typer.Argument(help="A labelled file or a built-in dataset")],
    val: Annotated[str | None, typer.Option(help="Validation file")] = None,
    test: Annotated[str | None, typer.Option(help="Test file")] = None,
    text_column: Annotated[str, typer.Option(help="Text column")] = TrainConfig.text_column,
    label_column: Annotated[str, typer.Option(help="Label column")] = TrainConfig.label_column,
    model: Annotated[str | None, typer.Option(help="Count tokens with this model's tokenizer")] = None,
    max_length: Annotated[int, typer.Option(help="Token limit to check against")] = TrainConfig.max_length,
    multi_label: Annotated[bool, typer.Option(help="Several labels per row")] = False,
    label_separator: Annotated[
        str, typer.Option(help="Between a row's labels (CSV)")
    ] = TrainConfig.label_separator,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON")] = False,
) -> None:
    """Sizes, label counts, duplicates, train/test leakage and lengths, without training."""
    from loracls.data.tables import check_source

    try:
        for source in (data, val, test):
            if source is not None:
                check_source(source)
        quiet_libraries()
        from loracls.data.inspection import inspect_data, print_inspection

        cfg = TrainConfig(
            data=data,
            val=val,
            test=test,
            text_column=text_column,
            label_column=label_column,
            max_length=max_length,
            multi_label=multi_label,
            label_separator=label_separator,
        )
        tokenizer = None
        if model:
            from loracls.model import load_tokenizer_for

            tokenizer = load_tokenizer_for(model)  # a GGUF model is not converted just to count tokens
        report = inspect_data(cfg, tokenizer)
    except LoraclsError as e:
        fail(e)
    if as_json:
        sys.stdout.write(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
        return
    print_inspection(report, console)


@data_app.command("audit", cls=HelpCommand)
def data_audit(
    data: Annotated[str, typer.Argument(help="A labelled file or a built-in dataset")],
    model: Annotated[str, typer.Option(help="The base model whose hidden states read the texts")] = (
        TrainConfig.model
    ),
    text_column: Annotated[str, typer.Option(help="Text column")] = TrainConfig.text_column,
    label_column: Annotated[str, typer.Option(help="Label column")] = TrainConfig.label_column,
    max_length: Annotated[int, typer.Option(help="Tokens read per text", min=1)] = TrainConfig.max_length,
    folds: Annotated[int, typer.Option(help="Cross-validation folds", min=2)] = 5,
    max_examples: Annotated[
        int | None, typer.Option(help="Audit a stratified sample of this many rows", min=2)
    ] = None,
    out: Annotated[
        Path, typer.Option(help="The flagged rows, most suspicious first (.csv or .jsonl)")
    ] = Path("label_issues.csv"),
    clean_out: Annotated[
        Path | None, typer.Option(help="Also write the audited rows without the flagged ones (.csv)")
    ] = None,
    top: Annotated[int, typer.Option(help="Flagged rows shown here", min=0)] = 10,
    precision: Annotated[str, typer.Option(help="auto, fp32 or bf16")] = "auto",
) -> None:
    """Find the rows whose label is probably wrong: the frozen base model reads each text, a cross-validated
    logistic regression on what it read gives every row out-of-sample probabilities, and cleanlab flags the
    rows those contradict (no LoRA run is trained)."""
    from loracls.data.tables import check_source

    try:
        check_source(data)
        check_output(out, (".csv", ".jsonl"))
        if clean_out is not None:
            check_output(clean_out, (".csv",))
        quiet_libraries()
        from loracls.training.audit import audit

        cfg = TrainConfig(
            data=data, model=model, text_column=text_column, label_column=label_column, max_length=max_length
        )
        table, issues, summary = audit(cfg, folds, max_examples, precision)
    except LoraclsError as e:
        fail(e)
    for note in summary["notes"]:
        console.print(f"data: {note}", soft_wrap=True)
    console.print(
        f"read {summary['rows']} texts with {model}; a {summary['folds']}-fold logistic regression on its "
        f"hidden states: cross-validated accuracy {summary['cross_validated_accuracy']:.3f}; "
        f"[bold]{summary['flagged']} rows flagged ({summary['flagged'] / summary['rows']:.1%})[/] "
        f"in {summary['seconds']:.0f} s",
        soft_wrap=True,
    )
    if top and len(issues):
        console.print(issues_table(issues.head(top), console.width))
    write_table(out, issues)
    console.print(f"{len(issues)} flagged rows written to {out}", soft_wrap=True)
    if clean_out is not None:
        kept = table[~table["id"].isin(set(issues["id"]))]
        kept = kept.rename(columns={"text": text_column, "label": label_column})
        write_table(clean_out, kept)
        console.print(f"{len(kept)} rows without them written to {clean_out}", soft_wrap=True)


def issues_table(issues, width: int):
    """The first flagged rows as a rich table of `width` columns, a line each: id, given and suggested label,
    the given one's probability, the text as far as it fits."""
    from rich.table import Table
    from rich.text import Text

    rows = [
        [str(row.id), str(row.label), str(row.suggested), f"{row.p_label:.3f}", " ".join(row.text.split())]
        for row in issues.itertuples()
    ]
    headers = ("id", "label", "suggested", "p(label)")
    fixed = sum(max(len(name), *(len(row[i]) for row in rows)) for i, name in enumerate(headers))
    room = max(12, width - fixed - 3 * (len(headers) + 1) - 1)  # each column's padding and rule
    shown = Table(*headers, "text")
    for row in rows:
        text = Text(row[-1], no_wrap=True, overflow="ellipsis")
        text.truncate(room, overflow="ellipsis")
        shown.add_row(*row[:-1], text)
    return shown


def select(
    path: Annotated[Path, typer.Argument(help="A finished run folder or an export folder")],
    pool: Annotated[Path, typer.Option(help="Unlabelled texts, in any format --data reads")],
    n: Annotated[int, typer.Option("--n", help="How many texts to choose", min=1)] = 100,
    out: Annotated[Path, typer.Option(help="The chosen rows, label column empty (.csv or .jsonl)")] = Path(
        "to_label.csv"
    ),
    text_column: Annotated[
        str | None, typer.Option(help="Text column of --pool (default: the run's)")
    ] = None,
    diverse: Annotated[
        bool, typer.Option(help="Cluster the least sure texts so that the chosen ones differ")
    ] = True,
    seed: Annotated[int, typer.Option(help="Seed of the clustering")] = 0,
    allow_unfinished: Annotated[bool, UNFINISHED] = False,
) -> None:
    """Choose the texts to label next: those the classifier is least sure of, spread over the kinds of text
    it is unsure about; writes them in the training file's layout with the label column empty (and what the
    classifier now predicts), to label and add to the training data."""
    from loracls.data.tables import check_source
    from loracls.inference.export_format import folder_kind

    try:
        folder_kind(path)
        check_source(pool)
        check_output(out, (".csv", ".jsonl"))
        quiet_libraries()
        from loracls.inference import select as chooser
        from loracls.inference.predict import Classifier
        from loracls.inference.predictions import read_texts

        classifier = Classifier.load(path, allow_unfinished=allow_unfinished)
        column = text_column or classifier.text_column
        frame, _ = read_texts(pool, column)
        pooled, notes = chooser.pool_table(frame, column, chooser.known_texts(path))
        texts = pooled[column].astype(str).tolist()
        chosen, probs, unsure = chooser.select(classifier, texts, n, diverse, seed)
    except LoraclsError as e:
        fail(e)
    for note in notes:
        console.print(f"pool: {note}", soft_wrap=True)
    label_column = chooser.label_column(path)
    table = chooser.selection_table(pooled, chosen, probs, unsure, classifier.labels, label_column)
    write_table(out, table)
    console.print(
        f"chose {len(table)} of {len(texts)} texts (mean uncertainty {table['uncertainty'].mean():.3f}, "
        f"the pool's {unsure.mean():.3f}); written to {out}: fill in `{label_column}` and add them to the "
        "training data",
        soft_wrap=True,
    )


def check_output(path: Path, suffixes: tuple[str, ...]) -> None:
    """Refuse an output path of another kind than `suffixes`, or in a folder that does not exist, before
    anything loads."""
    if path.suffix.lower() not in suffixes:
        raise LoraclsError(f"{path}: write {' or '.join(suffixes)}")
    if not path.parent.is_dir():
        raise LoraclsError(f"{path}: the folder {path.parent} does not exist")


def write_table(path: Path, table) -> None:
    """A table as `.csv`, else JSON lines, atomically."""
    from loracls.files import write_text

    if path.suffix.lower() == ".csv":
        write_text(path, table.to_csv(index=False))
    else:
        write_text(path, table.to_json(orient="records", lines=True, force_ascii=False))
