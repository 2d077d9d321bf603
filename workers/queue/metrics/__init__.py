"""What workers publish about their own work, beside the queue: stage latencies (``stages``),
the denoise engine's rows and waits (``engine``), step-cache and reuse savings
(``step_cache``, ``reuse``) and the adapters each worker holds (``adapters``)."""
