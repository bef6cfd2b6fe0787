"""A griffe extension: remat's docstrings title their doctests ``Example:``; griffe reads ``Examples:``.

Google style (which griffe parses) names the section ``Examples``; with the singular title
griffe renders the doctest lines as prose. This extension retitles the section as the API
reference is built, so the docstrings stay as the project writes them.
"""
from __future__ import annotations

import re
from typing import Any

import griffe

_EXAMPLE_TITLE = re.compile(r"^(\s*)Example:\s*$", re.M)


class ExampleSections(griffe.Extension):
    """Renames each docstring's ``Example:`` section title to ``Examples:``."""

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = _EXAMPLE_TITLE.sub(r"\1Examples:", obj.docstring.value)
