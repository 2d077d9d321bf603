"""``python -m cli``: the ``diffcache`` command without its console script."""

from cli.main import app

app()
