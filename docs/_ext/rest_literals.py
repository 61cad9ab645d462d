"""A griffe extension for the API reference: the docstrings mark a code block the reST
way, with ``::`` closing the paragraph before it. Markdown already takes the indented
block after a blank line as code; this drops the marker it would print instead."""

from __future__ import annotations

from typing import Any

import griffe


def markdown_literals(text: str) -> str:
    """``text`` with each paragraph-closing ``::`` made ``:``, and a lone ``::`` dropped."""
    lines = []
    for line in text.split("\n"):
        stripped = line.rstrip()
        if stripped.strip() == "::":
            continue
        lines.append(stripped[:-1] if stripped.endswith("::") else line)
    return "\n".join(lines)


class RestLiterals(griffe.Extension):
    """Applies ``markdown_literals`` to every docstring griffe loads."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_literals(obj.docstring.value)
