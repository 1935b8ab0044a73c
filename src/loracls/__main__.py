"""`python -m loracls`: the same command line as `loracls`."""

from loracls.cli import app

app()
