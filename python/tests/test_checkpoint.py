"""Checkpoints from the adapter: resuming is exact with states on NVMe, damage is named, and the CLI reads them."""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

import strata
from strata import _strata
from models import TinyGPT, batches, relative_errors, strata_losses, three_tiers

STRATA_BIN = os.path.join(os.path.dirname(strata.__file__), "..", "..", "bin", "strata")


def trained(tmp_path, name, precision, seed=0):
    """A fresh TinyGPT (from `seed`) on three tiers, its NVMe files under tmp_path/name."""
    (tmp_path / name).mkdir()
    torch.manual_seed(seed)
    return strata.initialize(TinyGPT(), three_tiers(tmp_path / name, precision=precision))


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_resuming_from_a_checkpoint_is_exact(tmp_path, precision):
    """5 steps, save, 5 more: the same losses and parameters, bit for bit, as a process that starts from another
    initialization, loads the checkpoint and runs the 5 more."""
    data = list(batches(10))
    first = trained(tmp_path, "first", precision)
    strata_losses(first, data[:5])
    saved = first.save_checkpoint(tmp_path / "ckpt")
    assert saved["step"] == 5 and saved["path"] == str(tmp_path / "ckpt" / "step-00000005")
    assert {c["home"] for c in first.engine.chunks()} >= {"nvme"}  # some state saved from NVMe
    expected = strata_losses(first, data[5:])

    second = trained(tmp_path, "second", precision, seed=1)
    before = second.state_dict(master=True)
    assert not any(torch.equal(value, first.state_dict(master=True)[name]) for name, value in before.items())
    loaded = second.load_checkpoint(tmp_path / "ckpt")
    assert (loaded["step"], loaded["bytes"], loaded["skipped"]) == (5, saved["bytes"], [])
    assert strata_losses(second, data[5:]) == expected
    theirs, ours = first.state_dict(master=True), second.state_dict(master=True)
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs)


def test_a_damaged_checkpoint_is_named_and_the_one_before_loads(tmp_path):
    data = list(batches(2))
    engine = trained(tmp_path, "run", "fp32")
    strata_losses(engine, data[:1])
    engine.save_checkpoint(tmp_path / "ckpt")
    at_one = engine.state_dict()
    strata_losses(engine, data[1:])
    engine.save_checkpoint(tmp_path / "ckpt")
    damaged = tmp_path / "ckpt" / "step-00000002" / "rank0" / "chunk-0.bin"
    raw = bytearray(damaged.read_bytes())
    raw[10] ^= 0xFF
    damaged.write_bytes(bytes(raw))

    fresh = trained(tmp_path, "fresh", "fp32", seed=1)
    # The file, and what its chunk holds.
    damage = r"chunk-0\.bin does not match its CRC32C.*holds the param"
    with pytest.raises(strata._strata.CorruptionError, match=damage):
        fresh.load_checkpoint(tmp_path / "ckpt")
    # Its state is now partly overwritten: training raises until a load succeeds.
    with pytest.raises(RuntimeError, match="a load failed part way"):
        fresh.save_checkpoint(tmp_path / "elsewhere")
    loaded = fresh.load_checkpoint(tmp_path / "ckpt", fall_back=True)
    assert loaded["step"] == 1 and "chunk-0.bin" in loaded["skipped"][0]
    assert all(torch.equal(value, fresh.state_dict()[name]) for name, value in at_one.items())
    assert fresh.save_checkpoint(tmp_path / "elsewhere")["step"] == 1

    if not os.path.exists(STRATA_BIN):
        pytest.skip("no strata CLI in this build")
    verify = subprocess.run([STRATA_BIN, "checkpoint", "verify", str(tmp_path / "ckpt")], capture_output=True,
                            text=True)
    assert verify.returncode == 1 and "chunk-0.bin does not match its CRC32C" in verify.stderr, verify.stderr
    older = tmp_path / "ckpt" / "step-00000001"
    verify = subprocess.run([STRATA_BIN, "checkpoint", "verify", str(older)], capture_output=True, text=True)
    assert verify.returncode == 0 and verify.stdout.startswith(f"OK {older}: step 1"), verify.stdout + verify.stderr
    inspect = subprocess.run([STRATA_BIN, "checkpoint", "inspect", str(older)], capture_output=True, text=True)
    assert inspect.returncode == 0 and "step 1, saved by 1 rank(s)" in inspect.stdout, inspect.stdout + inspect.stderr


def test_an_asynchronous_save_holds_the_state_of_its_start(tmp_path):
    """5 steps, a save written (slowly: each chunk file opened 20 ms late) while 5 more run: a fresh engine that loads
    it and runs the 5 has the same losses and masters, bit for bit, so the steps' updates waited for the
    save. The next save waits for it."""
    data = list(batches(10))
    first = trained(tmp_path, "first", "fp32")
    strata_losses(first, data[:5])
    first._checkpoints.save_delay_ms = 20
    assert first.save_checkpoint(tmp_path / "ckpt", asynchronous=True) is None
    expected = strata_losses(first, data[5:])
    saved = first.wait_checkpoint()
    assert (saved["step"], saved["path"]) == (5, str(tmp_path / "ckpt" / "step-00000005"))
    assert first.wait_checkpoint() is None
    assert first.save_checkpoint(tmp_path / "ckpt", asynchronous=True) is None
    assert first.save_checkpoint(tmp_path / "ckpt")["step"] == 10  # waited for the one before
    with pytest.raises(ValueError, match="in flight"):  # the C++ API refuses what the adapter waits for
        pending = _strata.start_checkpoint(first.engine, first._optimizer, str(tmp_path / "other"), 0, None, 50)
        try:
            _strata.load_checkpoint(first.engine, first._optimizer, str(tmp_path / "ckpt"))
        finally:
            pending.wait()
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".spare", "latest", "step-00000005", "step-00000010"]

    second = trained(tmp_path, "second", "fp32", seed=1)
    second.load_checkpoint(tmp_path / "ckpt" / "step-00000005")
    assert strata_losses(second, data[5:]) == expected
    theirs, ours = first.state_dict(master=True), second.state_dict(master=True)
    assert all(torch.equal(theirs[name], ours[name]) for name in theirs)


def test_keep_last_recycles_the_files_of_a_removed_checkpoint(tmp_path):
    """With keep_last, the save after next writes over the files of the checkpoint removed (path/.spare
    holds them meanwhile), an asynchronous one too; recycle=False deletes them instead."""
    engine = trained(tmp_path, "run", "fp32")
    data = list(batches(4))
    saved = []
    for batch in data[:2]:
        strata_losses(engine, [batch])
        saved.append(engine.save_checkpoint(tmp_path / "ckpt", keep_last=1))
    strata_losses(engine, data[2:3])
    engine.save_checkpoint(tmp_path / "ckpt", keep_last=1, asynchronous=True)
    saved.append(engine.wait_checkpoint())
    assert [s["recycled"] for s in saved] == [0, 0, saved[2]["files"]] and saved[2]["files"] > 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == [".spare", "latest", "step-00000003"]
    strata_losses(engine, data[3:])
    assert engine.save_checkpoint(tmp_path / "ckpt", keep_last=1, recycle=False)["recycled"] == 0
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["latest", "step-00000004"]


def test_an_asynchronous_save_is_finished_when_the_process_exits(tmp_path):
    """A process that starts a save and exits at once, without waiting, leaves it published (by the exit
    hook, or by the save's destructor when the engine is collected first)."""
    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(__file__)!r})
import torch, strata
from models import TinyGPT, batches, strata_losses, three_tiers
torch.manual_seed(0)
engine = strata.initialize(TinyGPT(), three_tiers({str(tmp_path)!r}))
strata_losses(engine, list(batches(2)))
engine.save_checkpoint({str(tmp_path / "ckpt")!r}, asynchronous=True)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    verified = strata._strata.verify_checkpoint(str(tmp_path / "ckpt"))
    assert verified["step"] == 2 and verified["files"] > 0


def test_saving_mid_step_is_refused(tmp_path):
    engine = trained(tmp_path, "run", "fp32")
    tokens = next(iter(batches(1)))
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    with pytest.raises(RuntimeError, match="between steps only"):
        engine.save_checkpoint(tmp_path / "ckpt")
    engine.step()
    assert engine.save_checkpoint(tmp_path / "ckpt")["step"] == 1


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="no mpirun (OpenMPI's openmpi-bin)")
@pytest.mark.parametrize("shard_params,save",
                         [("false", "save"), ("true", "save"), ("false", "save-async"), ("true", "save-async")])
def test_two_ranks_resume_exactly_and_one_process_loads_their_checkpoint(tmp_path, shard_params, save):
    """Two ranks under mpirun save after 3 steps and train 3 more; two fresh ranks from another initialization
    load and train the same 3: the same losses and masters, bit for bit (with comm.shard_params too, and with
    the save written while the 3 steps run). One process on the whole batch loads the two ranks' checkpoint
    and trains on as they did (to 1e-5)."""
    worker = os.path.join(os.path.dirname(__file__), "dp_checkpoint_worker.py")

    def run(world, phase, name):
        (tmp_path / name).mkdir()
        args = [sys.executable, worker, phase, str(tmp_path / "ckpt"), str(tmp_path / name),
                str(tmp_path / name / "out.pt"), shard_params]
        command = [shutil.which("mpirun"), "-np", str(world), "--oversubscribe", *args] if world > 1 else args
        env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
        assert done.returncode == 0, done.stdout + done.stderr
        return torch.load(tmp_path / name / "out.pt")

    saved = run(2, save, "saved")
    loaded = run(2, "load", "loaded")
    assert loaded["losses"] == saved["losses"]
    assert all(torch.equal(value, loaded["final"][name]) for name, value in saved["final"].items())
    alone = run(1, "load", "alone")  # with comm.shard_params the checkpoint holds masters, no params
    assert max(relative_errors(alone["losses"], saved["losses"])) <= 1e-5, (alone["losses"], saved["losses"])
    assert all(torch.allclose(value, alone["final"][name], rtol=1e-4, atol=1e-6)
               for name, value in saved["final"].items())


def test_a_checkpoint_saved_with_other_searched_chunks_names_the_size_to_set(tmp_path):
    """With chunk.size_elems unset the chunk size is searched from the budgets: a checkpoint taken under other
    budgets holds other chunks, and the load says which size to set."""
    def engine(name, seed, **extra):
        (tmp_path / name).mkdir()
        torch.manual_seed(seed)
        config = three_tiers(tmp_path / name, **extra)
        if "chunk" not in extra:
            del config["chunk"]
        return strata.initialize(TinyGPT(), config)

    data = list(batches(4))
    first = engine("first", 0, device={"budget": "96KiB"})
    strata_losses(first, data[:2])
    first.save_checkpoint(tmp_path / "ckpt")
    other = engine("other", 1, device={"budget": "1MiB"}, host={"budget": "4MiB"})
    with pytest.raises(ValueError, match=r"set chunk.size_elems to \d+ to load it") as refused:
        other.load_checkpoint(tmp_path / "ckpt")
    size = int(re.search(r"set chunk.size_elems to (\d+)", str(refused.value)).group(1))
    same = engine("same", 1, device={"budget": "1MiB"}, host={"budget": "4MiB"}, chunk={"size_elems": size})
    same.load_checkpoint(tmp_path / "ckpt")
    expected = strata_losses(first, data[2:])
    assert strata_losses(same, data[2:]) == expected
