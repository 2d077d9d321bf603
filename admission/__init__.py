"""Admission: what a request asks for (``body``), read against the served model and the
deployment's limits into a ``GenerationSpec`` or a field error (``request``), and the
schedules and edit-and-resume overrides it may carry (``editing``). Every door comes here."""
