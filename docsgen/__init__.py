"""The documentation's generated pages: references read from the live code, and benchmark
results rendered from the data the benches record (``docs/gen_pages.py`` writes them at each
``mkdocs build``)."""
