"""Data parallelism from the adapter: W ranks under mpirun, each on batch b, against one process on batch W*b."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from models import batches, bf16_states_losses, mixed_precision_losses, pair, relative_errors, torch_losses

MPIRUN = shutil.which("mpirun")


def launch(launcher, world, args, mpi_options=(), env=None):
    """dp_worker.py on `world` ranks started by mpirun or torchrun (`env`: added to the environment)."""
    worker = [os.path.join(os.path.dirname(__file__), "dp_worker.py")] + [str(a) for a in args]
    if launcher == "mpirun":
        command = [MPIRUN, "-np", str(world), "--oversubscribe", *mpi_options, sys.executable] + worker
    else:
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                   str(world)] + worker
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", **(env or {}))
    return subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)


def run_ranks(tmp_path, world, steps, batch, precision="fp32", launcher="mpirun", accumulation=1,
              shard_params=False, freeze="", close=True, train_step="", device_budget=96 * 1024, overlap=0,
              clip="", states="fp32"):
    """The worker on `world` ranks: rank 0's results, and every rank's bytes of each chunk kind and its comm stats."""
    out = str(tmp_path / "rank0")
    (tmp_path / "nvme").mkdir()  # the drive's directory; strata makes each rank's under it
    run = launch(launcher, world, [out, tmp_path / "nvme", steps, batch, precision, -1, accumulation],
                 env={"DP_SHARD_PARAMS": "true" if shard_params else "false", "DP_FREEZE": freeze,
                      "DP_TRAIN_STEP": train_step, "DP_DEVICE_BUDGET": str(device_budget),
                      "DP_OVERLAP": str(overlap), "DP_CLIP": str(clip), "DP_STATES": states,
                      **({} if close else {"DP_NO_CLOSE": "1"})})
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


def assert_trains_like_pytorch(result, steps, batch):
    """Rank 0's mean losses and final masters against plain PyTorch on the whole batch; returns that model."""
    _, reference = pair()
    theirs = torch_losses(reference, batches(steps, batch=batch))
    assert max(relative_errors(result["losses"], theirs)) <= 1e-5, (result["losses"], theirs)
    for name, value in reference.state_dict().items():
        if name in result["final"]:
            assert torch.allclose(result["final"][name], value, rtol=1e-4, atol=1e-5), name
    return reference


def state_bytes(bytes_of_kind):
    return sum(bytes_of_kind.get(kind, 0) for kind in ("master", "exp_avg", "exp_avg_sq"))


needs_mpirun = pytest.mark.skipif(MPIRUN is None, reason="no mpirun (OpenMPI's openmpi-bin)")


@pytest.mark.parametrize("launcher,world", [pytest.param("mpirun", 2, marks=needs_mpirun),
                                            pytest.param("mpirun", 4, marks=needs_mpirun), ("torchrun", 2)])
def test_ranks_train_like_one_process_with_the_whole_batch(tmp_path, launcher, world):
    steps, batch = 20, 8
    result = run_ranks(tmp_path, world, steps, batch, launcher=launcher)
    # Each rank's NVMe files in a directory of its own; each process its own GPU on the node.
    assert sorted(os.listdir(tmp_path / "nvme")) == [f"rank{r}" for r in range(world)]
    assert [rank["device_index"] for rank in result["ranks"]] == list(range(world))
    assert_trains_like_pytorch(result, steps, batch)

    # Every grad chunk's reduce-scatter began during backward, none waited for step().
    for rank in result["ranks"]:
        assert rank["reduced_in_backward"] == [rank["grad_chunks"]] * steps, rank["reduced_in_backward"]

    # Each rank holds its 1/W shard of the optimizer states (4096-element
    # chunks: a quarter of one is still a whole 4 KiB slot); params and grads whole.
    (tmp_path / "one").mkdir()
    alone = run_ranks(tmp_path / "one", 1, 0, batch, launcher=launcher)["ranks"][0]
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


@pytest.mark.parametrize("launcher,world", [pytest.param("mpirun", 2, marks=needs_mpirun),
                                            pytest.param("mpirun", 4, marks=needs_mpirun), ("torchrun", 2)])
def test_ranks_with_sharded_params_train_like_one_process_and_send_zero3s_volume(tmp_path, launcher, world):
    """comm.shard_params (ZeRO-3): each rank stores 1/W of the parameters too, gathers each param chunk when a
    module needs it, and a step sends ZeRO-3's 3 x parameter bytes x (W-1)/W."""
    steps, batch = 20, 8
    result = run_ranks(tmp_path, world, steps, batch, launcher=launcher, shard_params=True)
    reference = assert_trains_like_pytorch(result, steps, batch)
    for name in result["final"]:  # fp32: the parameters are the masters
        assert torch.equal(result["final_compute"][name], result["final"][name]), name
    # An evaluation forward after training gathers the updated parameters (not the last forward's).
    with torch.no_grad():
        tokens = next(iter(batches(1, batch=batch)))
        expected = reference(tokens[:, :-1], tokens[:, 1:]).item()
    assert abs(result["eval_loss"] - expected) <= 1e-5 * abs(expected), (result["eval_loss"], expected)

    # Stored on the host and NVMe: no parameters (every param chunk is
    # transient; the fp32 master shard is the rank's copy) and 1/W of the
    # params and states (each sharded chunk rounded up to its 4 KiB slot).
    (tmp_path / "one").mkdir()
    alone = run_ranks(tmp_path / "one", 1, 0, batch, launcher=launcher)["ranks"][0]
    whole = alone["stored_of_kind"]["param"] + state_bytes(alone["stored_of_kind"])
    for rank in result["ranks"]:
        assert all(c["transient"] for c in rank["chunks"] if c["kind"] == "param")
        assert rank["stored_of_kind"]["param"] == 0, rank["stored_of_kind"]
        sharded = sum(1 for c in rank["chunks"] if c["sharded"])
        assert state_bytes(rank["stored_of_kind"]) <= whole // world + 4096 * sharded, (rank, alone)
        assert rank["stored_of_kind"]["grad"] == alone["stored_of_kind"]["grad"]

    # ZeRO-3's volume: parameters gathered in forward and again in backward
    # (fp32 here, so the same bytes as the gradients' reduce-scatter), less
    # what the two kept chunks save, plus the tags, the padding and the
    # small all-reduces.
    for rank in result["ranks"]:
        comm = rank["comm"]
        zero3 = comm["zero3_bytes_per_step"]
        assert 0.95 * zero3 <= comm["last_step_bytes"] <= 1.05 * zero3, comm
        # From the second step on, the gathers are queued ahead of their need (the step before's order);
        # those whose chunk the pipeline had put on the device by then were filled there too.
        assert comm["param_gathers_ahead"] >= (steps - 1) / steps * comm["param_gathers"] - 2, comm
        assert 0 <= comm["param_gathers_filled_ahead"] <= comm["param_gathers_ahead"], comm


def test_torchrun_ranks_that_never_close_their_engine_exit_cleanly(tmp_path):
    """A script that neither closes nor frees its engine under torchrun: the exit hook closes the reducer,
    whose last gathers run through gloo as the interpreter shuts down. If gloo's thread freed those
    collectives' tensors it would need the GIL, and Python stops such a thread inside the destructor
    (std::terminate): before the communicator kept them, 4 runs of 12 aborted that way. And torch 2.x's gloo
    aborts about one exit in six when the process groups are still alive at exit, unless the communicator
    destroys them (its exit hook). Six runs."""
    for attempt in range(6):
        (tmp_path / str(attempt)).mkdir()
        result = run_ranks(tmp_path / str(attempt), 2, 3, 8, launcher="torchrun", shard_params=True, close=False)
        assert len(result["losses"]) == 3


@needs_mpirun
def test_one_rank_under_mpirun_takes_the_plain_path_and_trains_the_same(tmp_path):
    """mpirun -np 1: no reducer (its buffers would be host memory for nothing), the same training."""
    steps, batch = 6, 8
    result = run_ranks(tmp_path, 1, steps, batch)
    assert_trains_like_pytorch(result, steps, batch)
    rank = result["ranks"][0]
    assert rank["reduced_in_backward"] == [], rank["reduced_in_backward"]
    assert rank["comm"] is None


@needs_mpirun
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_with_sharded_params_frozen_parameters_are_sharded_too(tmp_path, precision):
    """comm.shard_params with the position embedding frozen: it is gathered like the others from a master
    shard in its own dtype (nothing updates it), no rank stores it whole, and training is unchanged."""
    steps, batch, world = 6, 8, 2
    result = run_ranks(tmp_path, world, steps, batch, precision=precision, shard_params=True, freeze="wpe")
    (tmp_path / "whole").mkdir()
    whole = run_ranks(tmp_path / "whole", world, steps, batch, precision=precision, freeze="wpe")
    assert result["losses"] == whole["losses"]  # bit for bit: sharding moves bytes, it computes nothing
    assert torch.equal(result["final"]["wpe"], result["initial"]["wpe"])  # frozen: as it started
    for name in result["final"]:
        assert torch.equal(result["final"][name], whole["final"][name]), name
    dtype = "fp32" if precision == "fp32" else "bf16"
    for rank in result["ranks"]:
        assert rank["stored_of_kind"]["param"] == 0, rank["stored_of_kind"]
        # The frozen chunk starts the forward: it is gathered ahead like the others (queued after the step's
        # all-reduce, its shard never changing), all but the first step's gathers.
        comm = rank["comm"]
        assert comm["param_gathers_ahead"] >= (steps - 1) / steps * comm["param_gathers"] - 2, comm
        groups = {c["group"] for c in rank["chunks"] if c["kind"] == "param"}
        frozen = [g for g in groups if not any(c["group"] == g and c["kind"] == "grad" for c in rank["chunks"])]
        assert frozen, "no frozen chunk group"
        for g in frozen:
            master = [c for c in rank["chunks"] if c["group"] == g and c["kind"] == "master"]
            assert len(master) == 1 and master[0]["sharded"] and master[0]["dtype"] == dtype, master
        # ZeRO-3's volume counts the frozen embedding twice (gathered in forward and backward), not three times.
        _, reference = pair()
        frozen_bytes = reference.wpe.numel() * (4 if precision == "fp32" else 2)
        assert comm["zero3_bytes_per_step"] == (3 * comm["model_bytes"] - frozen_bytes) * (world - 1) // world
    if precision == "fp32":
        _, reference = pair()
        reference.wpe.requires_grad_(False)
        theirs = torch_losses(reference, batches(steps, batch=batch))
        assert max(relative_errors(result["losses"], theirs)) <= 1e-5, (result["losses"], theirs)


@needs_mpirun
@pytest.mark.parametrize("launcher,world,shard_params", [pytest.param("mpirun", 2, False, marks=needs_mpirun),
                                                         pytest.param("mpirun", 4, False, marks=needs_mpirun),
                                                         ("torchrun", 2, True)])
def test_ranks_with_overlapped_updates_train_as_without_bit_for_bit(tmp_path, launcher, world, shard_params):
    """optimizer.overlap on W ranks: each group's update runs on its reduction during backward, and the run is
    the one without overlap, bit for bit; with clipping on most steps, the clipped ones are redone."""
    steps, batch = 6, 8
    for clip in ("", "0.5"):
        runs = {}
        for overlap in (0, 1 << 20):
            where = tmp_path / f"clip{clip}-overlap{overlap}"
            where.mkdir()
            runs[overlap] = run_ranks(where, world, steps, batch, launcher=launcher, shard_params=shard_params,
                                      overlap=overlap, clip=clip)
        after, overlapped = runs[0], runs[1 << 20]
        assert overlapped["losses"] == after["losses"], clip
        for name, value in after["final"].items():
            assert torch.equal(overlapped["final"][name], value), (clip, name)
        confirmed = [sum(b[0] for b in rank["overlapped"][1:]) for rank in overlapped["ranks"]]
        redone = [sum(b[1] for b in rank["overlapped"][1:]) for rank in overlapped["ranks"]]
        assert all(c > 0 for c in confirmed) if not clip else all(r > 0 for r in redone), (clip, confirmed, redone)
        assert not any(sum(b) for rank in after["ranks"] for b in rank["overlapped"])


@needs_mpirun
@pytest.mark.parametrize("shard_params", [False, True])
def test_ranks_with_bf16_states_train_like_one_process_with_them(tmp_path, shard_params):
    """optimizer.states bf16 on 2 ranks: each rank's shard of the moments in bf16, half the bytes of fp32 ones,
    and the run that of one process with its moments rounded after each step (the ranks sum the gradients in
    another order, so within a bf16 rounding's effect, not bit for bit)."""
    steps, batch = 6, 8
    runs = {}
    for states in ("fp32", "bf16"):
        (tmp_path / states).mkdir()
        runs[states] = run_ranks(tmp_path / states, 2, steps, batch, shard_params=shard_params, states=states)
    def used(rank, kind):
        return sum(c["used_bytes"] for c in rank["chunks"] if c["kind"] == kind)

    for r16, r32 in zip(runs["bf16"]["ranks"], runs["fp32"]["ranks"]):
        for kind in ("exp_avg", "exp_avg_sq"):
            assert 2 * used(r16, kind) == used(r32, kind) > 0, kind
    _, reference = pair()
    theirs = bf16_states_losses(reference, batches(steps, batch=batch))
    assert max(relative_errors(runs["bf16"]["losses"], theirs)) <= 1e-4, (runs["bf16"]["losses"], theirs)
    for name, value in reference.state_dict().items():
        if name in runs["bf16"]["final"]:
            assert torch.allclose(runs["bf16"]["final"][name], value, rtol=1e-3, atol=1e-4), name


def test_ranks_accumulating_gradients_train_like_one_process(tmp_path):
    steps, batch, accumulation = 12, 8, 2
    result = run_ranks(tmp_path, 2, steps, batch, accumulation=accumulation)
    _, reference = pair()
    theirs = torch_losses(reference, batches(steps, batch=batch), accumulation=accumulation)
    assert max(relative_errors(result["losses"], theirs)) <= 1e-5, (result["losses"], theirs)
    # Reductions begin only in the backward before a step: once per step, every grad chunk.
    for rank in result["ranks"]:
        assert rank["reduced_in_backward"] == [rank["grad_chunks"]] * (steps // accumulation)


@needs_mpirun
@pytest.mark.parametrize("shard_params", [False, True])
def test_ranks_in_layered_steps_train_as_in_standard_ones(tmp_path, shard_params):
    """engine.train_step over 2 ranks, 4 micro-batches a step: the layered order gives the standard one's losses
    and masters (TinyGPT ties its embedding: its gradient sums in another order, within rounding). Parameters
    sharded, a block's stay pinned (gathered once) until its last micro-batch's gradient: the device holds a
    block's chunks and the embedding's, 112KiB."""
    steps, batch, micro_batches = 10, 16, 4
    runs = {}
    for mode in ("standard", "layered"):
        (tmp_path / mode).mkdir()
        runs[mode] = run_ranks(tmp_path / mode, 2, steps, batch, accumulation=micro_batches,
                               shard_params=shard_params, train_step=mode, device_budget=128 * 1024)
    standard, layered = runs["standard"], runs["layered"]
    assert max(relative_errors(layered["losses"], standard["losses"])) <= 1e-6
    for name, value in standard["final"].items():
        assert (layered["final"][name] - value).norm() <= 1e-6 * value.norm(), name


@pytest.mark.parametrize("launcher,shard_params", [pytest.param("mpirun", False, marks=needs_mpirun),
                                                   pytest.param("mpirun", True, marks=needs_mpirun),
                                                   ("torchrun", True)])
def test_bf16_ranks_shard_the_masters_and_gather_them_whole(tmp_path, launcher, shard_params):
    """bf16: the masters sharded and fp32, the params gathered in bf16, the gradients reduce-scattered in
    bf16 (comm.reduce_dtype grad): the volume of ZeRO-3 (sharded) or 2/3 of it, counted in the compute dtype."""
    steps, batch = 10, 8
    result = run_ranks(tmp_path, 2, steps, batch, precision="bf16", launcher=launcher, shard_params=shard_params)
    model, reference = pair()
    # The fp32 values each rank wrote into its shard of the masters, gathered: exactly the model's.
    for name, value in model.state_dict().items():
        if name in result["initial"]:
            assert result["initial"][name].dtype == torch.float32
            assert torch.equal(result["initial"][name], value), name
    if shard_params:  # the bf16 param chunks are gathered from the fp32 master shards, never stored
        assert all(r["stored_of_kind"]["param"] == 0 for r in result["ranks"])
    else:  # half of fp32 over bf16 params
        assert all(r["bytes_of_kind"]["master"] < r["bytes_of_kind"]["param"] * 2 for r in result["ranks"])
    recipe = mixed_precision_losses(reference, batches(steps, batch=batch))
    assert max(relative_errors(result["losses"], recipe)) <= 2e-3, (result["losses"], recipe)
    for rank in result["ranks"]:
        comm = rank["comm"]
        zero3 = comm["zero3_bytes_per_step"]  # 3 x the bf16 parameters' bytes x (W-1)/W
        share = 1.0 if shard_params else 2 / 3
        assert 0.95 * share * zero3 <= comm["last_step_bytes"] <= 1.05 * share * zero3, comm


@pytest.mark.parametrize("launcher", [pytest.param("mpirun", marks=needs_mpirun), "torchrun"])
def test_a_rank_lost_mid_run_is_a_timeout_on_the_others(tmp_path, launcher):
    """mpirun: the last rank is SIGKILLed (mpirun told not to kill the survivors itself). torchrun: it
    hangs instead, since torchrun's agent would kill the survivors as soon as a worker dies."""
    out = str(tmp_path / "rank0")
    (tmp_path / "nvme").mkdir()
    env = {"DP_WORKER_HANG": "1"} if launcher == "torchrun" else {}
    run = launch(launcher, 3, [out, tmp_path / "nvme", 6, 6, "fp32", 3],
                 mpi_options=["--mca", "orte_abort_on_non_zero_status", "0"], env=env)
    assert run.returncode != 0
    for rank in (0, 1):
        with open(f"{out}.rank{rank}.error") as f:
            seen = json.load(f)
        # comm.timeout_ms is 2000 in the worker: the error comes within a few seconds, and says what happened.
        assert seen["error"].startswith("Timeout"), seen
        assert ("timed out after 2000 ms" if launcher == "mpirun" else "Timed out waiting 2000ms") in seen["error"]
        assert seen["seconds"] < 10, seen
    assert not os.path.exists(f"{out}.rank2.error")  # the rank that was lost wrote nothing


@needs_mpirun
def test_a_layer_skipped_on_one_rank_still_reduces_in_step_and_matches_pytorch(tmp_path):
    """Grad chunks complete in different orders on the ranks (and one never, some steps): the fixed
    submission order keeps their collectives lined up, and engine.comm waits for the reductions."""
    import dp_uneven_worker as worker
    steps, world = 6, 2
    out = str(tmp_path / "uneven")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    run = subprocess.run([MPIRUN, "-np", str(world), "--oversubscribe", sys.executable, worker.__file__, out,
                          str(steps)], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    with open(out + ".json") as f:
        ours = json.load(f)["losses"]
    # Plain PyTorch on the mean of the ranks' losses: the mean of their gradients.
    torch.manual_seed(0)
    reference = worker.Uneven()
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    theirs = []
    for step in range(steps):
        loss = sum(reference(worker.data(step, r), worker.uses_middle(r, world, step)) for r in range(world)) / world
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    assert max(relative_errors(ours, theirs)) <= 1e-5, (ours, theirs)
    states = [torch.load(f"{out}.rank{r}.pt") for r in range(world)]
    for name, value in reference.state_dict().items():
        assert torch.equal(states[0][name], states[1][name]), name
        assert torch.allclose(states[0][name], value, rtol=1e-4, atol=1e-5), name


@needs_mpirun
def test_with_sharded_params_a_forward_that_differs_between_ranks_is_an_error_on_each_not_a_hang(tmp_path):
    """comm.shard_params: the ranks gather param chunks as their modules run, so a layer skipped on one
    rank makes their gathers differ: every rank raises at once, naming the parameter all-gather."""
    import dp_uneven_worker as worker
    out = str(tmp_path / "uneven")
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", DP_SHARD_PARAMS="true")
    run = subprocess.run([MPIRUN, "-np", "2", "--oversubscribe", "--mca", "orte_abort_on_non_zero_status", "0",
                          sys.executable, worker.__file__, out, "6"], capture_output=True, text=True, timeout=600,
                         env=env)
    assert run.returncode != 0
    for rank in (0, 1):
        with open(f"{out}.rank{rank}.error") as f:
            seen = json.load(f)
        assert "all-gather" in seen["error"] and "chunk group" in seen["error"], seen
        assert seen["seconds"] < 10, seen
