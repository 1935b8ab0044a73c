"""The one console every stage prints its progress lines to (stderr; stdout is for results), and the tables
of metrics the commands print on it.

Under several processes, `train` makes it quiet on all but the main one, so each line appears once.
"""

from rich.console import Console
from rich.table import Table

console = Console(stderr=True)


def int8_line(check: dict) -> str:
    """How the int8 path compared with fp32 on the run's test split."""
    return (
        f"int8: same prediction as fp32 on {check['agreement']:.1%} of {check['texts']} test texts, accuracy "
        f"{check['accuracy_int8']:.4f} (fp32 {check['accuracy_fp32']:.4f})"
    )


def per_class_table(metrics: dict) -> Table:
    table = Table("class", "precision", "recall", "F1", "support")
    for name, row in metrics["per_class"].items():
        table.add_row(
            name,
            f"{row['precision']:.3f}",
            f"{row['recall']:.3f}",
            f"{row['f1-score']:.3f}",
            str(int(row["support"])),
        )
    return table


def confusion_table(metrics: dict) -> Table:
    names = list(metrics["per_class"])
    table = Table("gold \\ predicted", *names, title="confusion matrix")
    for name, row in zip(names, metrics["confusion_matrix"], strict=True):
        table.add_row(name, *map(str, row))
    return table
