"""A griffe extension: remat's docstrings, written for Sphinx-style readers, rendered by mkdocstrings.

The API reference is built by mkdocstrings (Google style, Markdown). remat's docstrings
title their doctests ``Example:`` (griffe reads ``Examples:``), name objects with Sphinx
roles (``:func:`plan` ``) and end a line with ``::`` before a literal block. This extension
rewrites the three as the reference is built, so the docstrings stay as the project writes
them: ``Examples:``, plain code spans, and a single colon.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_TITLE = re.compile(r"^(\s*)Example:\s*$", re.M)
_SPHINX_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj):`~?([^`]+)`")
_LITERAL_MARKER = re.compile(r"(\S)::$", re.M)


def markdown_docstring(text: str) -> str:
    """The docstring with the three Sphinx habits turned into what mkdocstrings reads."""
    text = _EXAMPLE_TITLE.sub(r"\1Examples:", text)
    text = _SPHINX_ROLE.sub(lambda m: f"`{m.group(1)}`", text)
    return _LITERAL_MARKER.sub(r"\1:", text)


class SphinxToMarkdown(griffe.Extension):
    """Rewrites every docstring with :func:`markdown_docstring` once the objects are loaded."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = markdown_docstring(obj.docstring.value)
