"""MkDocs hooks (mkdocs.yml): the docs' ```python blocks may name how tests/test_docs.py runs them
(```python torchrun, ```python gpu, ...); Python-Markdown's fences take a language alone, so the
site shows such a block as plain ```python."""

from __future__ import annotations

import re
from typing import Any

_FENCE = re.compile(r"^(\s*```python)[ \t]+\w+[ \t]*$", re.MULTILINE)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _FENCE.sub(r"\1", markdown)
