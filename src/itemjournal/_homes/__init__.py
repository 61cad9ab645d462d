"""The homes: where callers meet the journal (``once``, ``run_each``; ``itemjournal.asgi``
and ``itemjournal.otel`` are public modules of their own).
"""
