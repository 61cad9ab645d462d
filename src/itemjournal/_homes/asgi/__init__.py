"""The ASGI ``Idempotency-Key`` middleware's rooms; ``itemjournal.asgi`` is its public face.

``protocol`` holds the ASGI shapes every room speaks and how a reply is sent; ``keys``
reads a request's key fields and fingerprint from its scope; ``responses`` records a
response as it streams and replays a stored one; ``middleware`` the middleware itself,
which ties them together. The policy they apply is the one in ``_homes.http``, which the
WSGI middleware shares.
"""
