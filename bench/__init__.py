"""Benchmarks, run by hand as ``python -m bench.<name>``; each prints a table, then one JSON
line with the figures its issue names, measured against a baseline in the same run."""
