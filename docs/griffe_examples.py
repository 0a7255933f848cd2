"""A griffe extension for the API reference (mkdocs.yml): embcore's docstrings title their
doctests ``Example:``, which griffe's Google-style parser reads as an admonition of Markdown prose
(``>>>`` lines become block quotes); napoleon's ``Example:`` is griffe's ``Examples:``, a section of
runnable code. The docstrings stay as they are; this renames the title before griffe parses."""

from __future__ import annotations

import re
from typing import Any

from griffe import Extension, Object

_EXAMPLE = re.compile(r"^(\s*)Example:[ \t]*$", re.MULTILINE)


class ExampleSections(Extension):
    """``Example:`` read as ``Examples:`` in every docstring griffe loads."""

    def on_instance(self, *, obj: Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE.sub(r"\1Examples:", obj.docstring.value)
