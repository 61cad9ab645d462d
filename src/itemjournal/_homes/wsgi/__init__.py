"""The WSGI ``Idempotency-Key`` middleware's rooms; ``itemjournal.wsgi`` is its public face.

``protocol`` holds the WSGI shapes every room speaks, how a whole reply is started and
how a request is read; ``response`` carries the application's response to the server,
recorded, its last chunk held until the journal has settled the record; ``middleware``
the middleware itself, which ties them together on the blocking journal
(``itemjournal.sync``). The policy they apply is the one in ``_homes.http``, which the
ASGI middleware shares.
"""
