"""Make ``opscope_nb/data/builtin_en.txt``, the default calibration text.

Run once by a maintainer (``python scripts/make_builtin_text.py``); the file is
committed and its hash pinned (``tests/test_data.py``), so every Python
version calibrates on the same text.  The passages are prose paragraphs of the
docstrings of CPython's standard library (Python Software Foundation License
Version 2), parsed from the ``*.py`` sources of the running interpreter (the
committed file: CPython 3.11.7), in sorted file order, each kept when it reads
as English prose, re-flowed to one line and deduplicated, up to 400 000
characters.
"""
from __future__ import annotations

import ast
import os
import pathlib
import re
import sys
import sysconfig

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


def stdlib_passages(max_chars: int = 400_000) -> tuple:
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


if __name__ == "__main__":
    out = pathlib.Path(__file__).resolve().parents[1] / "opscope_nb" / "data" / "builtin_en.txt"
    paras = stdlib_passages()
    out.write_text("\n".join(paras) + "\n", encoding="utf-8")
    print(f"{out}: {len(paras)} passages from Python {sys.version.split()[0]}")
