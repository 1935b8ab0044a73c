"""The one console every stage prints its progress lines to (stderr; stdout is for results).

Under several processes, `train` makes it quiet on all but the main one, so each line appears once.
"""

from rich.console import Console

console = Console(stderr=True)
