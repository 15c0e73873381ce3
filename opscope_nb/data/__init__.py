"""Package data: ``sample_en.txt``, the built-in English evaluation text.

One passage per line, public-domain 19th-century prose (Jane Austen, *Pride and
Prejudice*, 1813, chapter 1; Charles Dickens, *A Tale of Two Cities*, 1859,
opening; Herman Melville, *Moby-Dick*, 1851, chapter 1 opening; Abraham
Lincoln, the Gettysburg Address, 1863), reproduced from memory for
``opscope-nb eval``; a few words may differ from the printed editions.
"""
from __future__ import annotations

import os

__all__ = ["SAMPLE_TEXT_PATH", "sample_passages"]

#: Path of the built-in sample text (one passage per line).
SAMPLE_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_en.txt")


def sample_passages() -> list:
    """The built-in passages (non-empty lines of ``sample_en.txt``), as str."""
    with open(SAMPLE_TEXT_PATH, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]
