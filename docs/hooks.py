"""MkDocs hooks: pages generated from the code, so they cannot drift.

* ``cli.md``: the marker ``<!-- cli-reference -->`` becomes, for the top-level
  command and every sub-command, a ``## <name>`` heading and its full
  ``--help`` text, taken from the argparse parsers
  (``opscope_nb.cli.build_parser``; if that is missing, from ``python -m
  opscope_nb [CMD] --help`` in a subprocess).
* ``kernels.md``: the marker ``<!-- kernel-table -->`` becomes a table of
  every name in ``opscope_nb.kernels.__all__`` with what it is and the first
  paragraph of its docstring.

Registered under ``hooks:`` in ``mkdocs.yml``.  Help text is formatted at a
fixed width of 80 columns, whatever the terminal.
"""
from __future__ import annotations

import argparse
import contextlib
import html
import os
import re
import subprocess
import sys

CLI_MARKER = "<!-- cli-reference -->"
KERNEL_MARKER = "<!-- kernel-table -->"
PROG = "opscope-nb"
WIDTH = "80"


@contextlib.contextmanager
def _columns(width=WIDTH):
    """argparse wraps help at ``$COLUMNS``; pin it while the help is formatted."""
    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = width
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old


def _hidden(parser):
    """Option strings a parser accepts but ``--help`` does not show
    (``help=argparse.SUPPRESS``: deprecated spellings)."""
    return [s for a in parser._actions if a.help == argparse.SUPPRESS
            for s in a.option_strings if s not in ("-h", "--help")]


def _help_from_parsers():
    """``[(name, help text, hidden options)]``: the top-level parser, then each
    sub-command in ``--help`` order; ``None`` when the parser builder cannot be
    imported."""
    try:
        from opscope_nb.cli import build_parser
    except ImportError:
        return None
    with _columns():
        parser = build_parser()
        out = [(PROG, parser.format_help(), _hidden(parser))]
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    out.append((name, sub.format_help(), _hidden(sub)))
    return out


def _run_help(*words):
    env = dict(os.environ, COLUMNS=WIDTH, MPLBACKEND="Agg")
    r = subprocess.run([sys.executable, "-m", "opscope_nb", *words, "--help"],
                       capture_output=True, text=True, env=env, check=True)
    return r.stdout


def _help_from_subprocess():
    """The same list from ``python -m opscope_nb [CMD] --help``."""
    top = _run_help()
    names, seen = [], False
    for line in top.splitlines():
        if line.strip().startswith("{") or line.strip() == "COMMAND":
            seen = True
            continue
        m = re.match(r"^ {4}(\w[\w-]*)\s", line)
        if seen and m:
            names.append(m[1])
        elif seen and line and not line.startswith(" "):
            seen = False
    return [(PROG, top, [])] + [(n, _run_help(n), []) for n in names]


def cli_help():
    """``[(name, help text, hidden options)]`` of the top-level command and every
    sub-command."""
    got = _help_from_parsers()
    return got if got is not None else _help_from_subprocess()


def cli_reference() -> str:
    parts = []
    for name, text, hidden in cli_help():
        parts.append(f"## {name}\n\n```text\n{text.rstrip()}\n```\n")
        if hidden:
            opts = ", ".join(f"`{o}`" for o in hidden)
            parts.append(f"Also accepted but not shown by `--help` (deprecated spellings, "
                         f"kept working): {opts}.\n")
    return "\n".join(parts)


def _escape_text(text: str) -> str:
    """Markdown-safe text for a table cell: outside code spans, ``<``, ``>``,
    ``*`` and ``|`` are escaped; inside them, a ``|`` would end the cell, so a
    span holding one becomes plain escaped text."""
    parts = text.split("`")
    if len(parts) % 2 == 0:            # unbalanced backtick: treat all as text
        parts = [text.replace("`", "'")]
    out = []
    for i, part in enumerate(parts):
        if i % 2 and "|" not in part:
            out.append(f"`{part}`")
        else:
            out.append(html.escape(part, quote=False).replace("*", "\\*")
                       .replace("|", "&#124;"))
    return "".join(out)


def _first_paragraph(doc) -> str:
    if not doc:
        return ""
    lines = []
    for line in doc.strip().splitlines():
        if not line.strip():
            break
        lines.append(line.strip())
    text = " ".join(lines)
    text = re.sub(r":\w+:`~?([^`]+)`", r"``\1``", text)    # Sphinx roles -> literals
    text = re.sub(r"``([^`]+)``", r"`\1`", text)            # RST -> Markdown literals
    if len(text) > 240:
        text = text[:237].rsplit(" ", 1)[0]
        if text.count("`") % 2:
            text += "`"
        text += " …"
    return _escape_text(text)


def _what(obj) -> str:
    tname = type(obj).__name__
    if tname.endswith("Dispatcher"):
        opts = getattr(obj, "targetoptions", {}) or {}
        return "njit, parallel" if opts.get("parallel") else "njit"
    if tname == "_Intrinsic":
        return "intrinsic (numba code only)"
    if callable(obj):
        return "Python function"
    return f"constant ({tname})"


def kernel_table() -> str:
    import opscope_nb.kernels as k
    rows = ["| name | what | description |", "| --- | --- | --- |"]
    for name in k.__all__:
        obj = getattr(k, name)
        if callable(obj):
            desc = _first_paragraph(getattr(obj, "__doc__", None))
        else:
            r = repr(obj)
            ok = len(r) <= 60 and "|" not in r and "`" not in r and "\n" not in r
            desc = f"`{r}`" if ok else f"`{type(obj).__name__}`, see its source"
        rows.append(f"| `{name}` | {_what(obj)} | {desc} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown, page, config, files):
    src = page.file.src_uri
    if src == "cli.md" and CLI_MARKER in markdown:
        markdown = markdown.replace(CLI_MARKER, cli_reference())
    if src == "kernels.md" and KERNEL_MARKER in markdown:
        markdown = markdown.replace(KERNEL_MARKER, kernel_table())
    return markdown
