"""Issue 26 item 0: the default objective follows the output (sum rel_err**2
without calibration, sensitivity x out_err**2 with it), ``--objective weight``
stays as the seed's choice, and a plan whose predicted output damage is far
above the run's best at the same budget is flagged on stderr and in plan.json."""
from __future__ import annotations

import numpy as np
import pytest

from opscope_nb.allocate import output_objective, predicted_damage
from opscope_nb.cli._plan import run_allocators
from opscope_nb.mining import Decomp, DecompOption, LayerProfile


def _layer(i, sens=None, out_err=None):
    # bytes 100 / 75 / 1 at relative errors 0 / 0.1 / 0.39: concentrating the
    # error in one layer is cheaper in sum rel_err, four times worse in sum rel_err**2
    ds = (Decomp.dense(), Decomp.int8(), Decomp.intn(2, 32))
    errs, sizes = (0.0, 0.1, 0.39), (100, 75, 1)
    opts = [DecompOption(d, e, b, 10, {}, None if out_err is None else out_err[k])
            for k, (d, e, b) in enumerate(zip(ds, errs, sizes))]
    return LayerProfile(f"l{i}", 10, 10, 100, opts, {}, sens)


def test_output_objective_and_damage_twin():
    layers = [_layer(i) for i in range(4)]
    assert output_objective(layers) == "output"
    choice = [0, 0, 0, 2]
    assert predicted_damage(layers, choice) == pytest.approx(0.39 ** 2)
    cal = [_layer(i, sens=2.0 + i, out_err=(0.0, 0.2, 0.5)) for i in range(4)]
    assert output_objective(cal) == "sensitivity"
    assert predicted_damage(cal, [1, 0, 0, 2]) == pytest.approx(2.0 * 0.04 + 5.0 * 0.25)


def test_weight_plan_is_flagged_default_is_not(capsys):
    layers = [_layer(i) for i in range(4)]
    spec = {"budget_frac": 301 / 400}
    w = run_allocators(layers, dict(spec, objective="weight"), ("exact", "greedy"))
    a = w["exact"][0]
    assert sorted(a.choice) == [0, 0, 0, 2]                 # concentrated
    assert a.extra["predicted_damage"] == pytest.approx(0.39 ** 2)
    assert a.extra["damage_flag"] == pytest.approx(0.39 ** 2 / (4 * 0.01))
    err = capsys.readouterr().err
    assert "predicted output damage" in err and "--objective weight" in err
    d = run_allocators(layers, dict(spec), ("exact",))       # default: auto -> output
    b = d["exact"][0]
    assert list(b.choice) == [1, 1, 1, 1]                    # spread
    assert b.extra["objective"] == "output" and "damage_flag" not in b.extra
    assert b.extra["predicted_damage"] == pytest.approx(4 * 0.01)
    assert "damage" not in capsys.readouterr().err


def test_cli_default_objective_is_recorded(tmp_path):
    import json
    from opscope_nb.cli import main
    out = tmp_path / "o"
    assert main(["profile", "--include", "k_proj|q_proj", "--rank-cap", "4", "--method",
                 "greedy", "--out", str(out), "-q"]) == 0
    plan = json.load(open(out / "plan.json"))
    assert plan["objective"] == "auto" and plan["objective_used"] == "output"
    g = plan["methods"]["greedy"]
    assert g["total_err"] == pytest.approx(sum(r["rel_err"] ** 2 for r in g["layers"]))
    assert np.isfinite(g["extra"]["predicted_damage"])
