"""A communicator written in Python (how torchrun's ranks talk): the seam's contract from the Python side."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import strata
from strata import _strata


class TwoRanksEcho(_strata.Communicator):
    """Rank 0 of two whose peer always sends what this rank sends; broadcasts time out."""

    def __init__(self):
        super().__init__(0, 2, "echo")

    def _all_gather(self, send, recv):
        recv[:len(send)] = send
        recv[len(send):] = send

    def _broadcast(self, data, root):
        raise RuntimeError("[gloo] Timed out waiting 2000ms for recv operation to complete")


def test_collectives_reach_the_python_methods_and_are_counted():
    comm = TwoRanksEcho()
    assert (comm.rank, comm.world_size, comm.describe()) == (0, 2, "echo")
    assert comm.all_gather(b"abc") == b"abcabc"
    stats = comm.stats()
    assert stats["all_gather"]["calls"] == 1 and stats["all_gather"]["bytes"] == 3  # (W - 1) x 3 bytes sent


def test_an_exception_is_a_timeout_or_comm_error_and_breaks_the_group():
    comm = TwoRanksEcho()
    with pytest.raises(RuntimeError, match=r"Timeout: broadcast on rank 0 timed out: .*Timed out waiting"):
        comm.broadcast(bytearray(8), 0)
    # Broken: every later collective fails at once, whatever it is.
    with pytest.raises(RuntimeError, match=r"CommError: all-gather on rank 0: the group is broken"):
        comm.all_gather(b"abc")


def test_a_missing_method_is_named():
    comm = TwoRanksEcho()
    with pytest.raises(RuntimeError, match=r"does not define _all_reduce_sum\(\)"):
        comm.all_reduce_sum([1.0])


def test_a_bad_root_is_refused_before_python_sees_it():
    with pytest.raises(ValueError, match="root 5 is not a rank"):
        TwoRanksEcho().broadcast(bytearray(8), 5)


def test_a_reducer_collected_with_a_reduction_queued_on_a_python_communicator_does_not_hang():
    """Its queued job needs the GIL: the reducer must let go of it while it waits (in a subprocess, so a
    hang is a failed test, not a stuck suite)."""
    script = textwrap.dedent("""
        import time
        import strata
        from strata import _strata

        class Slow(_strata.Communicator):
            def __init__(self):
                super().__init__(0, 2, "slow")
            def _all_gather(self, send, recv):
                recv[:len(send)] = send
                recv[len(send):] = send
            def _reduce_scatter_sum(self, send, recv, count, dtype):
                time.sleep(0.5)
                recv[:] = send[:len(recv)]

        config = strata.load_config({"device": {"backend": "emulated", "budget": 1 << 20},
                                     "host": {"budget": 4 << 20}, "chunk": {"size_elems": 4096},
                                     "log": {"level": "error"}})
        comm = Slow()
        engine = _strata.Engine(config.options, comm)
        engine.register_tensor("w", [4096], "fp32", True, "m")
        engine.finalize()
        reducer = _strata.GradReducer(engine, comm)
        reducer.submit([c["id"] for c in engine.chunks() if c["kind"] == "grad"][0])
        del reducer
        print("collected")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and "collected" in run.stdout, run.stdout + run.stderr


def test_releasing_gathered_chunks_with_a_gather_ahead_on_a_python_communicator_does_not_hang():
    """release_gathered waits for the gathers queued ahead, whose collectives a Python communicator runs with
    the GIL: it must let go of it while it waits (in a subprocess, so a hang is a failed test)."""
    script = textwrap.dedent("""
        import time
        import strata
        from strata import _strata

        class Slow(_strata.Communicator):
            def __init__(self):
                super().__init__(0, 2, "slow")
            def _all_gather(self, send, recv):
                time.sleep(0.3)
                recv[:len(send)] = send
                recv[len(send):] = send

        config = strata.load_config({"device": {"backend": "emulated", "budget": 1 << 20},
                                     "host": {"budget": 4 << 20}, "chunk": {"size_elems": 4096},
                                     "comm": {"shard_params": True}, "log": {"level": "error"}})
        comm = Slow()
        engine = _strata.Engine(config.options, comm)
        for name in ("a", "b"):
            engine.register_tensor(name, [4096], "fp32", True, name)
        engine.finalize()
        params = [c["id"] for c in engine.chunks() if c["transient"]]
        assert len(params) == 2, engine.chunks()
        reducer = _strata.GradReducer(engine, comm)
        for step in range(2):  # the second step gathers b ahead, as the first did it after a
            for chunk in params:
                pin = engine.access_chunk(chunk, "device")
                reducer.gather(pin)
                pin.release()
                if step == 1:
                    break
            reducer.release_gathered()
        assert reducer.gathered_ahead == 0 and reducer.gathers == 3, (reducer.gathered_ahead, reducer.gathers)
        reducer.close()
        print("released")
    """)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, env=env)
    assert run.returncode == 0 and "released" in run.stdout, run.stdout + run.stderr


def test_a_closed_reducer_refuses_work():
    comm = TwoRanksEcho()
    config = strata.load_config({"device": {"backend": "emulated", "budget": 1 << 20}, "host": {"budget": 4 << 20},
                                 "chunk": {"size_elems": 4096}, "log": {"level": "error"}})
    engine = _strata.Engine(config.options, comm)
    engine.register_tensor("w", [4096], "fp32", True, "m")
    engine.finalize()
    reducer = _strata.GradReducer(engine, comm)
    reducer.close()
    reducer.close()  # twice is fine
    with pytest.raises(RuntimeError, match="GradReducer: closed"):
        reducer.submit([c["id"] for c in engine.chunks() if c["kind"] == "grad"][0])


def test_comm_backend_picks_nccl_only_for_gpu_ranks_or_when_asked():
    from strata import distributed
    assert not distributed.wants_nccl("auto", 1, "cuda")  # one rank: no communicator at all
    assert distributed.wants_nccl("auto", 2, "cuda") == _strata.nccl_available()
    assert not distributed.wants_nccl("auto", 2, "emulated")
    assert distributed.wants_nccl("auto", 2, "auto") == _strata.cuda_device_available()
    assert not distributed.wants_nccl("host", 4, "cuda")
    assert distributed.wants_nccl("nccl", 1, "auto")
    with pytest.raises(ValueError, match="device.backend is emulated"):
        distributed.wants_nccl("nccl", 2, "emulated")


def test_comm_backend_nccl_without_a_gpu_is_a_clear_error_before_the_engine_is_made():
    if _strata.cuda_device_available():
        pytest.skip("a GPU is present")
    model = torch.nn.Linear(4, 4)
    with pytest.raises(RuntimeError, match="comm.backend host"):
        strata.initialize(model, {"comm": {"backend": "nccl"}, "log": {"level": "error"}})
    with pytest.raises(ValueError, match="comm.backend"):
        strata.initialize(model, {"comm": {"backend": "gloo"}})


def test_ranks_sharing_a_gpu_stay_on_the_host_group_under_auto_and_fail_under_nccl(monkeypatch, capsys):
    from strata import distributed

    def shared(bootstrap, device_index, timeout_ms):
        raise ValueError("NCCL communicator: ranks 0 and 1 are on the same GPU (0000:01:00.0 on node0)")

    monkeypatch.setattr(distributed._strata, "nccl_communicator", shared)
    assert distributed.nccl_communicator(None, 0, 1000, required=False) is None
    assert "collectives stay on host" in capsys.readouterr().err
    with pytest.raises(ValueError, match="on the same GPU"):
        distributed.nccl_communicator(None, 0, 1000, required=True)

    def other(bootstrap, device_index, timeout_ms):
        raise ValueError("NCCL communicator: device.index 7 is not one of this process's 1 CUDA device(s)")

    monkeypatch.setattr(distributed._strata, "nccl_communicator", other)
    with pytest.raises(ValueError, match="device.index 7"):  # any other refusal stands, even under auto
        distributed.nccl_communicator(None, 7, 1000, required=False)
