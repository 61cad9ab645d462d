"""Operator tools: the ``itemjournal`` command and the read-only viewer. They stand on the
journal (reconciliation, which ``Journal.reconcile`` shares, lives there); nothing below
imports them.
"""
