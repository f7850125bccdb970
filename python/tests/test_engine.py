import time

import pytest

import strata
from strata.engine import _PhaseClock


def small_options(**keys):
    config = {"device": {"backend": "emulated", "budget": "1MiB"}, "host": {"budget": "2MiB"},
              "chunk": {"size_elems": 16384}, "log": {"level": "warning"}}
    config.update(keys)
    return strata.load_config(config).options


def test_tensors_are_packed_into_chunks_with_their_states():
    engine = strata.Engine(small_options())
    w = engine.register_tensor("fc.weight", [64, 64], "fp32", True, "fc")
    b = engine.register_tensor("fc.bias", [64], "fp32", True, "fc")
    frozen = engine.register_tensor("embed.weight", [128, 32], "fp32", False, "embed")
    assert (w, b, frozen) == (0, 1, 2)
    engine.finalize()
    chunks = engine.chunks()
    kinds = sorted(c["kind"] for c in chunks)
    # The trainable module: param, grad, exp_avg, exp_avg_sq (fp32 needs no master); the frozen one: a param chunk.
    assert kinds == sorted(["param", "grad", "exp_avg", "exp_avg_sq", "param"])
    fc_param = next(c for c in chunks if c["kind"] == "param" and 0 in c["tensors"])
    assert fc_param["tensors"] == [0, 1]
    assert fc_param["used_bytes"] >= (64 * 64 + 64) * 4
    assert all(c["home"] == "host" for c in chunks)
    assert engine.host_staging_bytes == 0


def test_errors_are_the_engines_as_python_exceptions():
    engine = strata.Engine(small_options())
    engine.register_tensor("w", [16], "fp32")
    with pytest.raises(ValueError, match="w"):
        engine.register_tensor("w", [16], "fp32")  # the name again
    with pytest.raises(ValueError, match="dtype"):
        engine.register_tensor("v", [16], "fp64")
    engine.finalize()
    with pytest.raises(ValueError, match="finalized"):
        engine.finalize()
    # Model states beyond the host with no NVMe tier: MemoryError naming the budget.
    big = strata.Engine(small_options())
    big.register_tensor("big", [1 << 20], "fp32")
    with pytest.raises(MemoryError, match="host.budget"):
        big.finalize()


def test_the_emulated_device_is_told_by_the_device_not_by_an_nvme_directory_name(tmp_path):
    from strata.runtime import is_emulated
    nvme = tmp_path / "emulated-runs"
    nvme.mkdir()
    engine = strata.Engine(small_options(**{"nvme.dirs": str(nvme), "nvme.capacity": "1MiB"}), None)
    assert is_emulated(engine.describe_backends())
    assert not is_emulated(f"device: cuda:0 (H100, 80GiB); host: 4GiB pinned; nvme: io_uring O_DIRECT, 1 dir ({nvme})")


def test_a_step_phase_named_as_an_adapter_lap_adds_to_it_and_the_phases_still_sum_to_the_step():
    """The adapter's wait for the overlapped updates and the step's are one phase, overlap_wait: their sum."""
    clock = _PhaseClock()
    time.sleep(0.01)
    clock.lap("overlap_wait")
    adapter_wait = clock.phases["overlap_wait"]
    time.sleep(0.02)
    clock.split("train_step", {"overlap_wait": 0.005, "kernel": 0.01})
    assert clock.phases["overlap_wait"] == pytest.approx(adapter_wait + 0.005)
    assert clock.phases["kernel"] == 0.01
    assert sum(clock.phases.values()) == pytest.approx(clock.seconds(), abs=5e-3)
