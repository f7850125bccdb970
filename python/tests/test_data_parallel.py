"""Data parallelism from the adapter: W ranks under mpirun, each on batch b, against one process on batch W*b."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from models import batches, pair, relative_errors, torch_losses

MPIRUN = shutil.which("mpirun")


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun (OpenMPI's openmpi-bin)")
@pytest.mark.parametrize("world", [2, 4])
def test_ranks_train_like_one_process_with_the_whole_batch(tmp_path, world):
    steps, batch = 20, 8
    out = str(tmp_path / "rank0")
    (tmp_path / "nvme").mkdir()  # the drive's directory; strata makes each rank's under it
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = subprocess.run([MPIRUN, "-np", str(world), "--oversubscribe", sys.executable,
                          os.path.join(os.path.dirname(__file__), "dp_worker.py"), out, str(tmp_path / "nvme"),
                          str(steps), str(batch)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(out + ".json") as f:
        result = json.load(f)
    assert result["world"] == world
    # Each rank's NVMe files in a directory of its own.
    assert sorted(os.listdir(tmp_path / "nvme")) == [f"rank{r}" for r in range(world)]

    _, reference = pair()
    theirs = torch_losses(reference, batches(steps, batch=batch))
    assert max(relative_errors(result["losses"], theirs)) <= 1e-5, (result["losses"], theirs)
    state = torch.load(out + ".pt")
    for name, value in reference.state_dict().items():
        if name in state:
            assert torch.allclose(state[name], value, rtol=1e-4, atol=1e-5), name
