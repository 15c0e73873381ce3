"""The default calibration text is a fixed, versioned package file (issue 57):
the same source gives the same plan under every Python version."""
import hashlib

from opscope_nb import data

#: SHA-256 of ``opscope_nb/data/builtin_en.txt`` (made by
#: ``scripts/make_builtin_text.py`` from CPython 3.11.7's docstrings).  A change
#: of the file changes every calibrated plan: update this with a CHANGELOG line.
BUILTIN_SHA256 = "3404c5dfbb74778e106ff138a9557b80c71875b1582e0bf89994ffa4b5da6795"


def test_builtin_text_is_the_pinned_file():
    with open(data.BUILTIN_TEXT_PATH, "rb") as f:
        assert hashlib.sha256(f.read()).hexdigest() == BUILTIN_SHA256


def test_builtin_passages_read_the_file_not_the_interpreter(monkeypatch):
    """No standard-library walk: a stdlib path that does not exist changes
    nothing."""
    import sysconfig
    data.builtin_passages.cache_clear()
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: {"stdlib": "/nonexistent"})
    got = data.builtin_passages()
    data.builtin_passages.cache_clear()
    assert len(got) == 1662 and all(p and "\n" not in p for p in got)
    assert sum(len(p) for p in got) > 400_000
