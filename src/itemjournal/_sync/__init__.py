"""The blocking face of the journal layer (``itemjournal.sync``).

Every module here is generated from its async source by ``tools/async_to_sync.py``
(each says from which), except ``turns``: how threads take turns on an identity and wake
a waiter, which is where threads and tasks truly differ.
"""
