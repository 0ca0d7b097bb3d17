"""A Griffe extension: show the code's reST-flavoured docstrings well in Markdown.

The docstrings are Google style with Sphinx roles (``:class:`Foo```) and literal
blocks introduced by ``::``. Markdown has neither, so before mkdocstrings renders a
docstring this turns each role into inline code and each ``::`` into ``:`` (the
indented block after it is already a Markdown code block). The source stays as is.
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const):`~?([^`]+)`")
_LITERAL = re.compile(r"::$", re.MULTILINE)


def markdown_from_rst(text: str) -> str:
    """Return ``text`` with Sphinx roles as inline code and ``::`` literal markers as ``:``."""
    text = _ROLE.sub(lambda match: f"`{match.group(1)}`", text)
    return _LITERAL.sub(":", text)


class RstRoles(griffe.Extension):
    """Rewrite every docstring with :func:`markdown_from_rst` once it is loaded."""

    def on_object(self, *, obj: griffe.Object, loader: Any, **kwargs: Any) -> None:
        """Rewrite ``obj``'s docstring, if it has one."""
        if obj.docstring is not None:
            obj.docstring.value = markdown_from_rst(obj.docstring.value)
