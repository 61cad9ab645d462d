"""``serve``: the read-only web viewer, started from the command. The viewer is an
extra (``itemjournal[viewer]``): it is imported only here, when asked for."""

from __future__ import annotations

import ipaddress

import click

from .errors import EXIT_OK, EXIT_PROBLEMS, CommandError
from .options import _journal_options, _settings

# ------------------------------------------------------------------------------- serve


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@click.command("serve")
@click.argument("where", required=False, default=None, metavar="[LOCATION]")
@click.option("--host", default="127.0.0.1", show_default=True, help="The address to bind.")
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=8080,
    show_default=True,
    help="The port (0: any free one).",
)
@click.option(
    "--token",
    envvar="ITEMJOURNAL_VIEWER_TOKEN",
    default=None,
    help="Required off loopback: checked on every request [env: ITEMJOURNAL_VIEWER_TOKEN].",
)
@_journal_options
@click.pass_context
def serve_command(
    ctx: click.Context,
    *,
    where: str | None,
    host: str,
    port: int,
    token: str | None,
    location: str | None,
    input_key_file: str | None,
    trust_shared_root: bool,
) -> int:
    """Serve a read-only web viewer of the journal (127.0.0.1 by default).

    The location may also be given here, as LOCATION, instead of with -L.
    """
    if where is not None and location is not None and where != location:
        raise click.UsageError("give the location once: as LOCATION or with -L", ctx)
    settings = _settings(ctx, where or location, input_key_file, trust_shared_root)
    if token is not None and not token.strip():
        raise CommandError("INVALID_ARGUMENT", "the viewer token must not be blank")
    if not _loopback(host) and token is None:
        raise CommandError(
            "TOKEN_REQUIRED",
            f"serving on {host} (not loopback) needs --token or ITEMJOURNAL_VIEWER_TOKEN",
        )
    try:
        from ..viewer.app import serve
    except ModuleNotFoundError as error:
        if error.name == "itemjournal._operator.viewer.app":
            raise CommandError(
                "VIEWER_UNAVAILABLE",
                "this version of itemjournal has no web viewer",
                exit_code=EXIT_PROBLEMS,
            ) from None
        raise CommandError(
            "VIEWER_UNAVAILABLE",
            f"the web viewer needs {error.name}: pip install 'itemjournal[viewer]'",
            exit_code=EXIT_PROBLEMS,
        ) from None
    serve(
        settings.location,
        host=host,
        port=port,
        token=token,
        input_key=settings.input_key,
        trust_shared_root=settings.trust_shared_root,
    )
    return EXIT_OK
