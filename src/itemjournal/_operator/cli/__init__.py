"""The ``itemjournal`` command."""
