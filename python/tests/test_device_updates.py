"""Updates the plan runs on the device (Note [Updates on the device] in offload/training/train_step.cc): where the
optimizer states fit beside everything else, each group's update runs where its chunks are and nothing crosses a link
in a step. On the emulated device the CPU kernel updates the device tier in place, so the results are the bits of
updates on the host."""

import pytest
import torch

import strata
from models import DEVICE_BUDGET, three_tiers


def train(tmp_path, device_budget, precision, steps=6):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                                torch.nn.Linear(64, 8))
    engine = strata.initialize(model, three_tiers(tmp_path, device={"budget": device_budget}, precision=precision))
    x, y = torch.randn(16, 64), torch.randn(16, 8)
    moved = []  # bytes over every link, by step
    for _ in range(steps):
        before = sum(link["bytes"] for link in engine.stats()["links"].values())
        prediction = engine(x.to(engine.dtype)).float()
        engine.backward(torch.nn.functional.mse_loss(prediction, y))
        engine.step()
        moved.append(sum(link["bytes"] for link in engine.stats()["links"].values()) - before)
    stats = engine.stats()
    params = engine.state_dict(master=precision != "fp32")
    groups = sum(1 for c in engine.engine.chunks() if c["kind"] == "grad")
    engine.close()
    return stats, moved, params, groups


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_states_that_fit_are_updated_on_the_device_and_nothing_moves_in_a_step(tmp_path, precision):
    (tmp_path / "fits").mkdir()
    (tmp_path / "tight").mkdir()
    fits, fits_moved, fits_params, groups = train(tmp_path / "fits", 4 << 20, precision)
    tight, tight_moved, tight_params, _ = train(tmp_path / "tight", DEVICE_BUDGET, precision)
    assert fits["pipeline"]["plan"]["updates_on_device"] == groups > 0
    assert fits_moved[-2:] == [0, 0], fits_moved
    # A device of a few chunks holds the states of one group at most: the others are updated on the host, and
    # chunks move each step.
    assert tight["pipeline"]["plan"]["updates_on_device"] < groups
    assert min(tight_moved[-2:]) > 0, tight_moved
    for name, values in fits_params.items():
        assert torch.equal(values, tight_params[name]), name
