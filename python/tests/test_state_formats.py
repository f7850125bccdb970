"""optimizer.states: the moments in bf16 train as torch's fused AdamW does with its moments rounded to bf16 after
every step and take half the bytes on every tier; every format resumes exactly, and a checkpoint of one format is
refused by an engine of another, naming both (int8 states: test_int8_states.py)."""

import os
import subprocess

import pytest
import torch

import strata
from models import batches, bf16_states_losses, pair, strata_losses, three_tiers

STEPS = 12
STRATA_BIN = os.path.join(os.path.dirname(strata.__file__), "..", "..", "bin", "strata")


def bf16_states(tmp_path, **extra):
    return three_tiers(tmp_path, optimizer={"states": "bf16"}, **extra)


def test_bf16_states_are_adamw_with_its_moments_rounded_once_a_step(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, bf16_states(tmp_path))
    assert {c["home"] for c in engine.engine.chunks()} >= {"host", "nvme"}  # states streamed from NVMe too
    data = batches(STEPS)
    ours = strata_losses(engine, data)
    theirs = bf16_states_losses(reference, data)
    assert ours == theirs and ours[-1] < ours[0]
    state = engine.state_dict()
    for name, value in reference.named_parameters():
        assert torch.equal(state[name], value.detach()), name
    # Not the fp32 states' run: the rounding changes the weights.
    model32, _ = pair()
    (tmp_path / "fp32").mkdir()
    fp32 = strata.initialize(model32, three_tiers(tmp_path / "fp32"))
    strata_losses(fp32, data)
    assert any(not torch.equal(fp32.state_dict()[name], value) for name, value in state.items())


def test_bf16_moments_take_half_the_bytes_of_fp32_ones(tmp_path):
    def moment_bytes(config):
        model, _ = pair()
        chunks = strata.initialize(model, config).engine.chunks()
        moments = [c for c in chunks if c["kind"] in ("exp_avg", "exp_avg_sq")]
        assert moments
        return {c["dtype"] for c in moments}, sum(c["used_bytes"] for c in moments)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    dtypes16, bytes16 = moment_bytes(bf16_states(tmp_path / "a"))
    dtypes32, bytes32 = moment_bytes(three_tiers(tmp_path / "b"))
    assert (dtypes16, dtypes32) == ({"bf16"}, {"fp32"})
    assert 2 * bytes16 == bytes32


@pytest.mark.parametrize("states,other", [("bf16", "fp32"), ("int8", "bf16"), ("fp32", "int8")])
def test_states_resume_exactly_and_another_format_is_refused_naming_both(tmp_path, states, other):
    data = batches(8)
    for name in ("first", "second", "other"):
        (tmp_path / name).mkdir()
    torch.manual_seed(0)
    model, _ = pair()
    first = strata.initialize(model, three_tiers(tmp_path / "first", optimizer={"states": states}))
    strata_losses(first, data[:4])
    first.save_checkpoint(tmp_path / "ckpt")
    expected = strata_losses(first, data[4:])

    model, _ = pair(seed=1)
    second = strata.initialize(model, three_tiers(tmp_path / "second", optimizer={"states": states}))
    second.load_checkpoint(tmp_path / "ckpt")
    assert strata_losses(second, data[4:]) == expected

    model, _ = pair(seed=1)
    refusing = strata.initialize(model, three_tiers(tmp_path / "other", optimizer={"states": other}))
    before = refusing.state_dict(master=True)
    with pytest.raises(Exception, match=rf"holds {states} optimizer states and this engine keeps {other} "
                                         rf"\(optimizer\.states {other}\): set optimizer\.states to {states}"):
        refusing.load_checkpoint(tmp_path / "ckpt")
    after = refusing.state_dict(master=True)
    assert all(torch.equal(before[name], after[name]) for name in before)  # nothing was read in


@pytest.mark.parametrize("states,moments", [("bf16", "bf16"), ("int8", "fp32, int8")])
def test_checkpoint_inspect_names_the_moments_format(tmp_path, states, moments):
    """int8: the small tensors' moments are fp32 (test_int8_states.py)."""
    if not os.path.exists(STRATA_BIN):
        pytest.skip(f"no strata CLI beside this strata package ({STRATA_BIN})")
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path, optimizer={"states": states}))
    strata_losses(engine, batches(2))
    engine.save_checkpoint(tmp_path / "ckpt")
    described = subprocess.run([STRATA_BIN, "checkpoint", "inspect", str(tmp_path / "ckpt")],
                               capture_output=True, text=True, check=True).stdout
    lines = {line.split()[0]: line for line in described.splitlines()}
    assert lines["optimizer:"].endswith(f"no loss scaler, {states} states"), described
    assert lines["exp_avg"].endswith(moments) and lines["exp_avg_sq"].endswith(moments), described
    assert lines["param"].endswith("fp32"), described


def test_an_unknown_states_format_is_refused_naming_the_choices(tmp_path):
    model, _ = pair()
    with pytest.raises(ValueError, match=r"optimizer\.states.*'int4'.*fp32, bf16, int8"):
        strata.initialize(model, three_tiers(tmp_path, optimizer={"states": "int4"}))
