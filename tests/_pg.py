"""Test helpers that reach into a PostgreSQL journal behind its back."""

from __future__ import annotations

import urllib.parse

import psycopg


def is_postgres(location: str) -> bool:
    return location.startswith(("postgresql://", "postgres://"))


def split(location: str) -> tuple[str, str]:
    """(libpq URL, schema) of a PostgreSQL journal location."""
    parts = urllib.parse.urlsplit(location)
    pairs = urllib.parse.parse_qsl(parts.query)
    schema = dict(pairs).get("schema", "itemjournal")
    rest = urllib.parse.urlencode([(n, v) for n, v in pairs if n not in ("schema", "pool_size")])
    return urllib.parse.urlunsplit(parts._replace(query=rest)), schema


def connect(location: str, *, autocommit: bool = True) -> tuple[psycopg.Connection, str]:
    url, schema = split(location)
    return psycopg.connect(url, autocommit=autocommit), schema


def put_document(location: str, digest: str, document: bytes) -> None:
    """Overwrite a record's stored bytes (its status column stays)."""
    connection, schema = connect(location)
    with connection:
        connection.execute(
            f"UPDATE {schema}.records SET document = %s WHERE digest = %s", (document, digest)
        )


def hold_row(location: str, digest: str) -> psycopg.Connection:
    """A transaction that holds the row of ``digest`` (inserting a placeholder if there is
    none): every writer of that record waits until the returned connection is closed."""
    connection, schema = connect(location, autocommit=False)
    found = connection.execute(
        f"SELECT 1 FROM {schema}.records WHERE digest = %s FOR UPDATE", (digest,)
    ).fetchone()
    if found is None:
        connection.execute(
            f"INSERT INTO {schema}.records (digest, status, claim_id, document) "
            "VALUES (%s, 'released', '', '')",
            (digest,),
        )
    return connection
