"""Package data: ``sample_en.txt``, the built-in English evaluation text, and
``builtin_en.txt`` (:func:`builtin_passages`), the larger default calibration
set.

One passage per line, public-domain 19th-century prose (Jane Austen, *Pride and
Prejudice*, 1813, chapter 1; Charles Dickens, *A Tale of Two Cities*, 1859,
opening; Herman Melville, *Moby-Dick*, 1851, chapter 1 opening; Abraham
Lincoln, the Gettysburg Address, 1863), reproduced from memory for
``opscope-nb eval``; a few words may differ from the printed editions.
"""
from __future__ import annotations

import functools
import os

__all__ = ["SAMPLE_TEXT_PATH", "BUILTIN_TEXT_PATH", "sample_passages", "builtin_passages",
           "TEXT_KEYWORDS"]

#: ``--calib-text`` / ``--text`` keywords: the built-in sample, the larger
#: built-in set (:func:`builtin_passages`).
TEXT_KEYWORDS = ("sample", "builtin")

#: Path of the built-in sample text (one passage per line).
SAMPLE_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_en.txt")


def sample_passages() -> list:
    """The built-in passages (non-empty lines of ``sample_en.txt``), as str."""
    with open(SAMPLE_TEXT_PATH, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


#: Path of the built-in calibration set (one passage per line).
BUILTIN_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "builtin_en.txt")


@functools.lru_cache(maxsize=1)
def builtin_passages() -> tuple:
    """The built-in calibration set: the non-empty lines of ``builtin_en.txt``.

    A fixed file shipped with the package (so the same source gives the same
    plan under every Python version): 1 662 prose paragraphs, 400 k
    characters (~90 k tokens for a BERT WordPiece vocabulary), taken from the
    docstrings of CPython 3.11.7's standard library (Python Software
    Foundation License Version 2) by ``scripts/make_builtin_text.py``: module,
    class and function docstrings split into paragraphs, each kept when it
    reads as English prose, re-flowed to one line and deduplicated.
    ``tests/test_data.py`` pins its hash.

    Returns
    -------
    tuple of str
        One passage per line.
    """
    with open(BUILTIN_TEXT_PATH, encoding="utf-8") as f:
        return tuple(ln.strip() for ln in f if ln.strip())
