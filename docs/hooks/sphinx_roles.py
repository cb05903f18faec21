"""MkDocs hook: the Sphinx roles of tslightning's docstrings (``:class:`~a.b.C```) as cross-references.

mkdocstrings' Google-style parser leaves a role as text (``:class:`` before the code span). Each one becomes an
optional mkdocs-autorefs reference: a link where the API reference documents the object, plain code where it does
not. A ``~`` shows the last component only, as Sphinx does.
"""

from __future__ import annotations

import html
import re

ROLE = re.compile(r":(?:class|mod|meth|func|attr|data|exc|obj):<code>(~?)([A-Za-z_][\w.]*)(\(\))?</code>")


def _reference(match: re.Match[str]) -> str:
    short, path, call = match.group(1), match.group(2), match.group(3) or ""
    title = path.rsplit(".", 1)[-1] if short else path
    return f'<autoref optional identifier="{html.escape(path)}"><code>{html.escape(title)}{call}</code></autoref>'


def roles_as_references(text: str) -> str:
    """``text`` (rendered HTML) with every Sphinx role's code span turned into an optional cross-reference."""
    return ROLE.sub(_reference, text)


def on_page_content(html_text: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    return roles_as_references(html_text)
