"""The ``Idempotency-Key`` policy both middlewares share; ``itemjournal.asgi`` and
``itemjournal.wsgi`` are its public faces.

``keys`` holds what a request becomes in the journal (its key, identity and fingerprint);
``problems`` the RFC 9457 answers; ``responses`` the stored form of a response, how it is
judged (kept, released, in need of review) and replayed; ``policy`` the checks of a
middleware's arguments and of a request before its application runs. Nothing here reads
a request or sends a response: ``asgi/`` and ``wsgi/`` do, each in its protocol's way.
"""
