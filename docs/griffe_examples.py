"""A griffe extension for the API reference (mkdocs.yml): embcore's docstrings are written to be
read as text, and two of their habits mean something else in Markdown. The docstrings stay as they
are; this adjusts them before griffe parses them.

- Doctests are titled ``Example:``, which griffe's Google-style parser reads as an admonition of
  Markdown prose (``>>>`` lines become block quotes); napoleon's ``Example:`` is griffe's
  ``Examples:``, a section of runnable code.
- A description may start with ``>`` (``epsilon: > 0``), a block quote in Markdown that drops the
  sign: it is escaped.
- ``2**63`` outside code is a power, not the start of bold text: ``**`` is escaped there (not in
  ````code```` spans, doctests or the indented blocks after ``::``, which Markdown shows as
  written).
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
# "name: > 0", "name (type): >= 0", or a line that starts with ">" (not a doctest's ">>>")
_QUOTE = re.compile(r"^(\s*(?:\*{0,2}\w+(?: \([^)]*\))?:[ \t]+)?)>(?!>>)", re.MULTILINE)


_CODE_SPAN = re.compile(r"(``?[^`]*``?)")
_POWER = re.compile(r"(?<=[\w)\]])\*\*")  # 2**63, x**p; not **kwargs


def _escape_powers(text: str) -> str:
    out, literal = [], None  # literal: the indentation of the "::" line whose block we are in
    for line in text.split("\n"):
        indent = len(line) - len(line.lstrip())
        if literal is not None and line.strip() and indent <= literal:
            literal = None
        code = literal is not None or line.lstrip().startswith((">>>", "..."))
        if not code:
            line = "".join(part if part.startswith("`") else _POWER.sub(r"\\*\\*", part)
                           for part in _CODE_SPAN.split(line))
        if literal is None and line.rstrip().endswith("::"):
            literal = indent
        out.append(line)
    return "\n".join(out)


class ExampleSections(Extension):
    """``Example:`` read as ``Examples:``, a leading ``>`` and a power's ``**`` escaped, in every
    docstring."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _escape_powers(_QUOTE.sub(r"\1\\>", text))
