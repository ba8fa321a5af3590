"""MkDocs hook: the site's home page is the README, its links made relative to docs/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def on_page_markdown(markdown: str, page, **_: object) -> str:
    if page.file.src_uri != "index.md":
        return markdown
    readme = (ROOT / "README.md").read_text()
    readme = re.sub(r"\]\(docs/", "](", readme)
    return readme.replace("](ARCHITECTURE.md)", "](architecture.md)")
