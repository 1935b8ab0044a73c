from loracls.cli import app

app()
