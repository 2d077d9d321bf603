"""Processes and their keeping: child processes that die with their parent (``processes``),
one-for-one restarts (``supervisor``), the embedded stack of Valkey and Mooncake
(``stack``) and the lock that keeps one stack per data directory (``instance_lock``)."""
