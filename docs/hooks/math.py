"""MkDocs hook: the pages' equations as MathML, rendered by the browser itself (no script, no network).

``pymdownx.arithmatex`` (generic mode) wraps each ``$$...$$`` block in ``<div class="arithmatex">\\[...\\]</div>``
and each ``$...$`` in a ``span``; this hook replaces their TeX with ``latex2mathml``'s MathML at build time.
"""

from __future__ import annotations

import html
import re

from latex2mathml.converter import convert

BLOCK = re.compile(r'<div class="arithmatex">\s*\\\[(.*?)\\\]\s*</div>', re.S)
INLINE = re.compile(r'<span class="arithmatex">\\\((.*?)\\\)</span>', re.S)


def equations_as_mathml(text: str) -> str:
    """``text`` (rendered HTML) with every arithmatex equation converted to MathML."""
    text = BLOCK.sub(lambda m: convert(html.unescape(m.group(1)).strip(), display="block"), text)
    return INLINE.sub(lambda m: convert(html.unescape(m.group(1)).strip()), text)


def on_page_content(html_text: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    return equations_as_mathml(html_text)
