"""Data parallelism from the adapter: W ranks under mpirun, each on batch b, against one process on batch W*b."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from models import batches, mixed_precision_losses, pair, relative_errors, torch_losses

MPIRUN = shutil.which("mpirun")


def run_ranks(tmp_path, world, steps, batch, precision="fp32"):
    """mpirun -np world dp_worker.py: rank 0's results, and every rank's bytes of each chunk kind and its comm stats."""
    out = str(tmp_path / "rank0")
    (tmp_path / "nvme").mkdir()  # the drive's directory; strata makes each rank's under it
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = subprocess.run([MPIRUN, "-np", str(world), "--oversubscribe", sys.executable,
                          os.path.join(os.path.dirname(__file__), "dp_worker.py"), out, str(tmp_path / "nvme"),
                          str(steps), str(batch), precision], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(out + ".json") as f:
        result = json.load(f)
    assert result["world"] == world
    result.update(torch.load(out + ".pt"))
    result["ranks"] = []
    for r in range(world):
        with open(f"{out}.rank{r}.json") as f:
            result["ranks"].append(json.load(f))
    return result


def state_bytes(bytes_of_kind):
    return sum(bytes_of_kind.get(kind, 0) for kind in ("master", "exp_avg", "exp_avg_sq"))


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun (OpenMPI's openmpi-bin)")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_train_like_one_process_with_the_whole_batch(tmp_path, world):
    steps, batch = 20, 8
    result = run_ranks(tmp_path, world, steps, batch)
    # Each rank's NVMe files in a directory of its own.
    assert sorted(os.listdir(tmp_path / "nvme")) == [f"rank{r}" for r in range(world)]

    _, reference = pair()
    theirs = torch_losses(reference, batches(steps, batch=batch))
    assert max(relative_errors(result["losses"], theirs)) <= 1e-5, (result["losses"], theirs)
    for name, value in reference.state_dict().items():
        if name in result["final"]:
            assert torch.allclose(result["final"][name], value, rtol=1e-4, atol=1e-5), name

    # Each rank holds its 1/W shard of the optimizer states (4096-element
    # chunks: a quarter of one is still a whole 4 KiB slot); params and grads whole.
    (tmp_path / "one").mkdir()
    alone = run_ranks(tmp_path / "one", 1, 0, batch)["ranks"][0]
    for rank in (r["bytes_of_kind"] for r in result["ranks"]):
        assert state_bytes(rank) <= state_bytes(alone["bytes_of_kind"]) // world, (rank, alone)
        assert (rank["param"], rank["grad"]) == (alone["bytes_of_kind"]["param"], alone["bytes_of_kind"]["grad"])

    # A step sends (W-1)/W of the fp32 gradients (reduce-scattered) and of
    # the parameters (gathered): 2/3 of ZeRO-3's three passes over the
    # parameters, plus shard padding and the small all-reduces.
    for rank in result["ranks"]:
        comm = rank["comm"]
        two_passes = 2 * comm["model_bytes"] * (world - 1) / world
        assert two_passes <= comm["last_step_bytes"] <= 1.05 * two_passes, comm
        assert comm["zero3_bytes_per_step"] == 3 * comm["model_bytes"] * (world - 1) // world


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun (OpenMPI's openmpi-bin)")
def test_bf16_ranks_shard_the_masters_and_gather_them_whole(tmp_path):
    steps, batch = 10, 8
    result = run_ranks(tmp_path, 2, steps, batch, precision="bf16")
    model, reference = pair()
    # The fp32 values each rank wrote into its shard of the masters, gathered: exactly the model's.
    for name, value in model.state_dict().items():
        if name in result["initial"]:
            assert result["initial"][name].dtype == torch.float32
            assert torch.equal(result["initial"][name], value), name
    assert all(r["bytes_of_kind"]["master"] < r["bytes_of_kind"]["param"] * 2 for r in result["ranks"])  # half of fp32 over bf16 params
    recipe = mixed_precision_losses(reference, batches(steps, batch=batch))
    assert max(relative_errors(result["losses"], recipe)) <= 2e-3, (result["losses"], recipe)
