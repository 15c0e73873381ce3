"""Dependency pins in pyproject.toml (review finding 7)."""
import os
import tomllib

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _requirements():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        deps = tomllib.load(f)["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


@pytest.mark.parametrize("name", ["numba", "llvmlite"])
def test_jit_stack_has_an_upper_bound_that_admits_the_installed_version(name):
    """The supported range (issue 56): numba 0.64-0.68 with their llvmlite
    (0.46-0.50), an upper bound (a new minor release is tested before it is
    admitted) that admits the installed version."""
    import importlib.metadata as md
    req = _requirements()[name]
    assert any(s.operator in ("<", "<=", "==", "~=") for s in req.specifier), (
        f"{name} has no upper bound in pyproject.toml: {req}")
    installed = Version(md.version(name))
    assert req.specifier.contains(installed, prereleases=True), (
        f"installed {name} {installed} is outside the pin {req.specifier}")
    lows = [Version(s.version) for s in req.specifier if s.operator == ">="]
    highs = [Version(s.version) for s in req.specifier if s.operator == "<"]
    want = {"numba": ("0.64", "0.69"), "llvmlite": ("0.46", "0.51")}[name]
    assert (lows, highs) == ([Version(want[0])], [Version(want[1])])
