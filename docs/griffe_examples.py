"""A griffe extension for the API reference (mkdocs.yml): embcore's docstrings are written to be
read as text, and two of their habits mean something else in Markdown. The docstrings stay as they
are; this adjusts them before griffe parses them.

- Doctests are titled ``Example:``, which griffe's Google-style parser reads as an admonition of
  Markdown prose (``>>>`` lines become block quotes); napoleon's ``Example:`` is griffe's
  ``Examples:``, a section of runnable code.
- A description may start with ``>`` (``epsilon: > 0``), a block quote in Markdown that drops the
  sign: it is escaped.
"""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)
# "name: > 0", "name (type): >= 0", or a line that starts with ">" (not a doctest's ">>>")
_QUOTE = re.compile(r"^(\s*(?:\*{0,2}\w+(?: \([^)]*\))?:[ \t]+)?)>(?!>>)", re.MULTILINE)


class ExampleSections(Extension):
    """``Example:`` read as ``Examples:``, and a leading ``>`` escaped, in every docstring."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            text = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
            obj.docstring.value = _QUOTE.sub(r"\1\\>", text)
