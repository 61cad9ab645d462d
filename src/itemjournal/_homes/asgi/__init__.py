"""The ``Idempotency-Key`` middleware's rooms; ``itemjournal.asgi`` is its public face.

``protocol`` holds the ASGI shapes every room speaks; ``keys`` what a request becomes in
the journal (its key, identity and fingerprint); ``problems`` the RFC 9457 answers;
``responses`` the stored form of a response, recorded as it streams and replayed;
``middleware`` the middleware itself, which ties them together.
"""
