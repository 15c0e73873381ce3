"""Package data: ``sample_en.txt``, the built-in English evaluation text, and
:func:`builtin_passages`, a larger calibration set every installation has.

One passage per line, public-domain 19th-century prose (Jane Austen, *Pride and
Prejudice*, 1813, chapter 1; Charles Dickens, *A Tale of Two Cities*, 1859,
opening; Herman Melville, *Moby-Dick*, 1851, chapter 1 opening; Abraham
Lincoln, the Gettysburg Address, 1863), reproduced from memory for
``opscope-nb eval``; a few words may differ from the printed editions.
"""
from __future__ import annotations

import ast
import functools
import os
import re
import sysconfig

__all__ = ["SAMPLE_TEXT_PATH", "sample_passages", "builtin_passages", "TEXT_KEYWORDS"]

#: ``--calib-text`` / ``--text`` keywords: the built-in sample, the larger
#: built-in set (:func:`builtin_passages`).
TEXT_KEYWORDS = ("sample", "builtin")

#: Path of the built-in sample text (one passage per line).
SAMPLE_TEXT_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "sample_en.txt")


def sample_passages() -> list:
    """The built-in passages (non-empty lines of ``sample_en.txt``), as str."""
    with open(SAMPLE_TEXT_PATH, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip()]


# stdlib directories that are tests, demos, vendored code or generated tables
_SKIP_DIRS = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages",
              "ensurepip", "turtledemo", "__pycache__", "pydoc_data", "encodings"}
_WORD = re.compile(r"[A-Za-z]+")


def _prose(par: str) -> bool:
    """Whether a docstring paragraph reads as English prose (not code, tables,
    parameter lists or doctests)."""
    if len(par) < 120 or len(par) > 1500 or ">>>" in par or "::" in par:
        return False
    if par[0] in "-*:=+|#([{" or par.rstrip()[-1] not in ".!?":
        return False
    words = _WORD.findall(par)
    if len(words) < 20:
        return False
    letters = sum(c.isalpha() or c.isspace() for c in par)
    if letters < 0.9 * len(par):
        return False
    # identifiers (snake_case, dotted names, calls) mark code-like text
    codeish = len(re.findall(r"\w+_\w+|\w+\.\w+\(|\(\)|`", par))
    return codeish <= len(words) // 15


@functools.lru_cache(maxsize=1)
def builtin_passages(max_chars: int = 400_000) -> tuple:
    """Prose paragraphs from the docstrings of this Python's standard library.

    Every installation has them (no download): the ``*.py`` files under
    ``sysconfig.get_paths()["stdlib"]`` are parsed (never imported) in sorted
    order, module / class / function docstrings split into paragraphs, each
    kept when it reads as English prose (:func:`_prose`: 120-1500 characters,
    ends a sentence, >= 90 % letters and spaces, few identifiers, no doctest),
    re-flowed to one line and deduplicated, until ``max_chars`` characters.
    The set depends on the Python version (3.11 gives ~1 800 paragraphs,
    ~400 k characters, ~90 k tokens for a BERT WordPiece vocabulary).

    Returns
    -------
    tuple of str
        One passage per paragraph (empty if the standard library sources are
        not installed).
    """
    root = sysconfig.get_paths().get("stdlib") or ""
    out, seen, total = [], set(), 0
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x not in _SKIP_DIRS and not x.startswith("."))
        for fn in sorted(files):
            if not fn.endswith(".py"):
                continue
            try:
                with open(os.path.join(d, fn), encoding="utf-8") as f:
                    tree = ast.parse(f.read())
            except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
                continue
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                         ast.AsyncFunctionDef)):
                    continue
                doc = ast.get_docstring(node, clean=True)
                if not doc:
                    continue
                for par in re.split(r"\n\s*\n", doc):
                    par = " ".join(par.split())
                    key = par.lower()
                    if key in seen or not _prose(par):
                        continue
                    seen.add(key)
                    out.append(par)
                    total += len(par)
                    if total >= max_chars:
                        return tuple(out)
    return tuple(out)
