"""Operator tools: reconciliation, the ``itemjournal`` command and the read-only viewer.
They stand on the journal; nothing below imports them.
"""
