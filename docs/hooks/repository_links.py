"""MkDocs hook: CHANGELOG.md on the site, its links written for the repository (``docs/page.md``) made the site's.

The changelog page (``docs/changelog.md``) includes ``CHANGELOG.md`` from the repository's root; there its links name
pages under ``docs/``, which the site serves from its root. The hook includes the file itself, links rewritten.
"""

from __future__ import annotations

import re
from pathlib import Path

REPOSITORY_LINK = re.compile(r"\]\(docs/([^)]+\.md(?:#[^)]*)?)\)")
INCLUDE = re.compile(r'^--8<-- "(CHANGELOG\.md)"$', re.M)


def site_links(markdown: str) -> str:
    """``markdown`` with every ``](docs/x.md)`` link made relative to the site's root."""
    return REPOSITORY_LINK.sub(r"](\1)", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:  # noqa: ARG001 - MkDocs' hook signature
    root = Path(config["docs_dir"]).parent
    return INCLUDE.sub(lambda match: site_links((root / match.group(1)).read_text()), markdown)
