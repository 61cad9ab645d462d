"""The viewer's look: its templates, stylesheet and icon (read from the package once),
the filter the templates use for times, and how an error becomes a page or a JSON answer.

The Jinja environment these templates render in is built by ``app`` (autoescape on, an
undefined name an error) and handed to ``Templates``, so importing ``app`` is what needs
Jinja2: ``itemjournal serve`` learns there whether the viewer extra is installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import resources
from typing import TYPE_CHECKING, Final

from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import Scope

if TYPE_CHECKING:
    import jinja2

_TITLES: Final = {
    400: "Bad request",
    401: "Authentication required",
    403: "Forbidden",
    404: "Not found",
    405: "Method not allowed",
    500: "Internal error",
    503: "Unavailable",
}


def _read_package_files() -> tuple[dict[str, str], bytes, bytes]:
    """The templates' text, the stylesheet and the icon, as the package holds them."""
    folder = resources.files("itemjournal") / "_viewer_templates"
    names = (
        "base.html",
        "index.html",
        "counts.html",
        "counts_nav.html",
        "detail.html",
        "invalid.html",
        "error.html",
    )
    templates = {name: (folder / name).read_text(encoding="utf-8") for name in names}
    return templates, (folder / "viewer.css").read_bytes(), (folder / "favicon.svg").read_bytes()


def _when(value: str | None) -> str:
    """An ISO-8601 UTC time as ``2025-01-31 12:34:56`` (the page says it is UTC)."""
    if not value:
        return "—"
    return value[:19].replace("T", " ")


class Templates:
    """The viewer's templates in one environment, and its two static files."""

    def __init__(self, environment: jinja2.Environment, css: bytes, icon: bytes) -> None:
        environment.filters["when"] = _when
        self.pages: Final = {
            name: environment.get_template(name) for name in environment.list_templates()
        }
        self.css: Final = css
        self.icon: Final = icon

    def render(self, name: str, context: Mapping[str, object]) -> str:
        return self.pages[name].render(context)

    def error(
        self,
        scope: Scope,
        status_code: int,
        code: str,
        message: str,
        *,
        headers: Mapping[str, str] | None = None,
        page: Mapping[str, object] | None = None,
    ) -> Response:
        """An error as JSON (under ``/api``) or as a page; ``page`` holds the links a page
        needs (left out for requests refused before they were let in)."""
        if _wants_json(scope):
            return JSONResponse(
                {"error": {"code": code, "message": message}}, status_code, headers=headers
            )
        context: dict[str, object] = {
            "index_url": "/",
            "css_url": "/static/viewer.css",
            "icon_url": "/static/favicon.svg",
            "location": "",
        }
        context.update(page or {})
        context.update(
            status_code=status_code,
            title=_TITLES.get(status_code, "Error"),
            code=code,
            message=message,
        )
        return HTMLResponse(self.render("error.html", context), status_code, headers=headers)


def _wants_json(scope: Scope) -> bool:
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root) :]
    return path == "/api" or path.startswith("/api/")
