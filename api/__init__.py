"""The REST API. It reaches workers only through ``workers.queue`` (submit, records, streams,
lifecycle) and imports no model code."""
