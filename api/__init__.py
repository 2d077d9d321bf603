"""The REST API. It reaches workers only through ``workers.submit``, ``workers.records`` and
``workers.streams``, and imports no model code."""
