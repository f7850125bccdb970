import pytest

import strata


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
