"""The documentation site builds in strict mode, and its generated pages cover
the code: every option of every sub-command on the CLI page, every public
kernel name on the kernels page.  Skipped without the ``docs`` extra."""
from __future__ import annotations

import argparse
import html
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mkdocs")
pytest.importorskip("material")                       # mkdocs-material
pytest.importorskip("mkdocstrings_handlers.python")   # mkdocstrings-python

ROOT = Path(__file__).resolve().parents[1]


def _cli_options() -> dict:
    """``{command: [option strings]}`` from the ``opscope-nb`` parsers."""
    from opscope_nb.cli import build_parser
    parser = build_parser()
    out = {"opscope-nb": [s for a in parser._actions for s in a.option_strings]}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out[name] = [s for a in sub._actions for s in a.option_strings]
    return out


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("docs") / "site"
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-f", str(ROOT / "mkdocs.yml"), "-d", str(out)],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"mkdocs build --strict failed:\n{r.stdout}\n{r.stderr}"
    return out


def test_cli_page_has_every_option_of_every_command(site):
    page = html.unescape((site / "cli" / "index.html").read_text(encoding="utf-8"))
    options = _cli_options()
    assert len(options) > 1, "no sub-commands found in the parser"
    missing = []
    for cmd, opts in options.items():
        if f'id="{cmd}"' not in page:
            missing.append(f"heading of {cmd}")
        start = page.find(f'id="{cmd}"')
        end = page.find("<h2 ", start + 1)
        section = page[start:] if end < 0 else page[start:end]
        for o in opts:
            if o not in section:
                missing.append(f"{cmd} {o}")
    assert not missing, f"cli page misses: {missing}"


def test_kernels_page_lists_every_public_kernel(site):
    import opscope_nb.kernels as k
    page = html.unescape((site / "kernels" / "index.html").read_text(encoding="utf-8"))
    missing = [n for n in k.__all__ if f"<code>{n}</code>" not in page]
    assert not missing, f"kernels page misses: {missing}"
