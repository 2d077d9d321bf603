"""Configuration: the one settings object every process reads once, from the environment and
``diffcache.yaml``, and passes down (``settings``)."""
