"""The import contract (issue 23): every module imports only from its own layer
or the ones below, and the package's import graph has no loop.

Read from the sources with ``ast`` (every ``import`` / ``from ... import``,
module-level or inside a function, counts), so the test needs no import of the
package and fails the moment an upward import or a loop is added.
"""
import ast
import pathlib

import pytest

PKG = pathlib.Path(__file__).resolve().parents[1] / "opscope_nb"

#: Lowest first: the package's folders.  A module imports only from modules of
#: its layer or below.  ``opscope_nb`` (the top-level ``__init__``) imports
#: nothing at module level (its lazy names are strings).
LAYERS = {
    0: ["opscope_nb", "_validation", "_threads", "_memory", "kernels", "data"],
    1: ["formats"],
    2: ["io"],
    3: ["runtime"],
    4: ["profile", "plan", "models"],
    5: ["distributed"],
    6: ["cli", "bench", "warmup", "__main__"],
}

#: Upward imports allowed, each a documented lazy re-export in a module-level
#: ``__getattr__`` (none).
SHIMS = set()


def _modules():
    out = {}
    for p in sorted(PKG.rglob("*.py")):
        rel = p.relative_to(PKG.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = p
    return out


MODS = _modules()


def _top(mod):
    """The layer key of a module: ``opscope_nb.cli.profile`` -> ``cli``."""
    parts = mod.split(".")
    return "opscope_nb" if len(parts) == 1 else parts[1]


def _layer(mod):
    top = _top(mod)
    for lv, names in LAYERS.items():
        if top in names:
            return lv
    raise AssertionError(f"{mod} is in no layer of tests/test_layers.py::LAYERS; add it")


def _resolve(mod, node):
    pkg = mod if MODS[mod].name == "__init__.py" else mod.rsplit(".", 1)[0]
    if node.level:
        base = pkg.split(".")
        base = base[:len(base) - (node.level - 1)]
        return ".".join(base + ([node.module] if node.module else []))
    return node.module


def _edges(mod):
    """``{(target module, in __getattr__)}`` for every package import in ``mod``."""
    tree = ast.parse(MODS[mod].read_text())
    shim_nodes = set()
    for fn in tree.body:
        if isinstance(fn, ast.FunctionDef) and fn.name == "__getattr__":
            shim_nodes |= {id(n) for n in ast.walk(fn)}
    out = set()
    for n in ast.walk(tree):
        targets = []
        if isinstance(n, ast.ImportFrom):
            base = _resolve(mod, n)
            if not base or not base.startswith("opscope_nb"):
                continue
            for a in n.names:
                sub = f"{base}.{a.name}"
                targets.append(sub if sub in MODS else base)
        elif isinstance(n, ast.Import):
            targets = [a.name for a in n.names if a.name.startswith("opscope_nb")]
        for t in targets:
            while t not in MODS:
                t = t.rsplit(".", 1)[0]
            out.add((t, id(n) in shim_nodes))
    return out


GRAPH = {m: _edges(m) for m in MODS}


def test_every_module_has_a_layer():
    for m in MODS:
        _layer(m)


def test_no_upward_import():
    bad = []
    for m, edges in GRAPH.items():
        for t, shim in edges:
            if _layer(t) > _layer(m):
                if shim and (_top(m), _top(t)) in SHIMS:
                    continue
                bad.append(f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def _cycle():
    """One import cycle among the package's modules, or None.  Every edge
    counts: module-level or inside a function, and a package's ``__init__``
    importing its own submodule (a submodule importing its package's
    ``__init__`` then closes a loop)."""
    adj = {m: sorted({t for t, _shim in e if t != m}) for m, e in GRAPH.items()}
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in adj[m]:
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state:
                c = visit(t)
                if c:
                    return c
        state[m] = 2
        stack.pop()
        return None

    for m in sorted(adj):
        if m not in state:
            c = visit(m)
            if c:
                return c
    return None


def test_no_import_loop():
    c = _cycle()
    assert c is None, "import loop: " + " -> ".join(c)


def test_contract_catches_violations(monkeypatch):
    """The checks fail when a violation is added (guards against a test that
    cannot fail): an upward edge, and a loop."""
    g = {m: set(e) for m, e in GRAPH.items()}
    g["opscope_nb.formats"].add(("opscope_nb.profile.mining", False))
    monkeypatch.setattr(__import__(__name__), "GRAPH", g)
    with pytest.raises(AssertionError, match="upward imports"):
        test_no_upward_import()
    assert _cycle() is not None     # formats -> mining -> formats


def test_public_names_from_the_top_level():
    """The top level reaches the public names lazily; each is the object of
    its one module."""
    import opscope_nb
    from opscope_nb.formats import Decomp
    from opscope_nb.profile.mining import profile_layer
    from opscope_nb.runtime import PackedLinear
    assert opscope_nb.Decomp is Decomp and opscope_nb.profile_layer is profile_layer
    assert opscope_nb.PackedLinear is PackedLinear
    from opscope_nb.profile import probe
    assert opscope_nb.probe is probe
    with pytest.raises(AttributeError):
        opscope_nb.no_such_name


def test_no_same_name_private_twins():
    """No module has a private twin of the same name elsewhere in the package
    (``probe`` / ``_probe``): a public module and its ``@njit`` core live
    together, or the core has a name of its own in ``kernels/``."""
    names = {}
    for m in MODS:
        leaf = m.rsplit(".", 1)[-1]
        if leaf == "opscope_nb" or leaf.startswith("__"):
            continue
        names.setdefault(leaf.lstrip("_"), set()).add(m)
    twins = {k: v for k, v in names.items()
             if len(v) > 1 and any(x.rsplit(".", 1)[-1].startswith("_") for x in v)}
    assert not twins, twins
