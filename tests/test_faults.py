"""The test-fault hook (train.observe.faults): one variable, parsed in one place."""

import pytest
import torch

from genrec.train.observe import faults


def test_the_variable_arms_each_kind():
    assert faults.parse("") == faults.Faults()
    got = faults.parse("kill=1:7, stall=0:6:1.5,nan=tower.layers.1:5")
    assert got == faults.Faults(kill=(1, 7), stall=(0, 6, 1.5), nan=("tower.layers.1", 5))


@pytest.mark.parametrize("spec", ["kill=1", "stall=1:2", "nan=tower", "explode=1:2", "kill=a:b"])
def test_a_mistyped_fault_is_an_error_naming_the_variable(spec):
    with pytest.raises(ValueError, match=f"GENREC_FAULTS='{spec}'.*expected kill=RANK:STEP"):
        faults.parse(spec)


def test_faults_fire_only_where_armed(monkeypatch):
    monkeypatch.delenv(faults.ENV, raising=False)
    assert faults.stall_seconds(1, 6) == 0.0
    faults.kill_after_step(0, 1)  # unarmed: returns
    monkeypatch.setenv(faults.ENV, "stall=1:6:2.5")
    assert (faults.stall_seconds(1, 6), faults.stall_seconds(0, 6), faults.stall_seconds(1, 5)) == (2.5, 0.0, 0.0)


def test_nan_fault_breaks_one_submodule_at_one_step(monkeypatch):
    monkeypatch.setenv(faults.ENV, "nan=1:3")
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    step = 2
    faults.install_nan(model, lambda: step)
    x = torch.ones(1, 2)
    assert torch.isfinite(model(x)).all()
    step = 3
    assert torch.isnan(model(x)).all() and torch.isfinite(model[0](x)).all()
