"""How often the adapter waits for the device: engine.stats()'s host_syncs, counted on every device (each is a
host-GPU synchronization on CUDA)."""

import torch

import strata
from models import three_tiers


def syncs_per_step(tmp_path, blocks, steps=3):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(blocks)])
    engine = strata.initialize(model, three_tiers(tmp_path, chunk={"size_elems": 4096}))
    x = torch.randn(4, 16)
    counts = []
    for _ in range(steps):
        engine.backward(engine(x).square().mean())
        engine.step()
        counts.append(engine.stats()["last_step"]["host_syncs"])
    return counts, engine.stats()["host_syncs"]


def test_each_step_reports_the_host_synchronizations_since_the_one_before(tmp_path):
    counts, total = syncs_per_step(tmp_path, 8)
    assert counts[0] > 0 and len(set(counts)) == 1, counts  # the same work each step, the same count
    assert total == sum(counts)


def test_the_host_synchronizations_per_step_do_not_grow_with_the_modules(tmp_path):
    # Chunks are let go after a fence on torch's stream (Note [Fences] in memory/residency.cc), not after a
    # synchronization: there were 33 a step with 8 blocks and 257 with 64.
    (tmp_path / "8").mkdir()
    (tmp_path / "64").mkdir()
    few, _ = syncs_per_step(tmp_path / "8", 8, steps=2)
    many, _ = syncs_per_step(tmp_path / "64", 64, steps=2)
    assert few[-1] == many[-1] <= 8, (few, many)


def test_a_chunk_let_go_after_a_fence_is_unpinned_and_its_fence_complete_on_the_host(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(16, 16))
    engine = strata.initialize(model, three_tiers(tmp_path))
    fence = engine.engine.record_fence(0)
    assert fence.done  # the emulated device's framework computes on the host: done when it lets go
    access = engine.engine.access_chunk(0, "device")
    access.release_after(fence)
    assert not access.valid
    assert memoryview(access).nbytes == 0
    before = engine.stats()["fence_waits"]
    engine.engine.access_chunk(0, "host").release()  # a move off the device: no wait for a completed fence
    assert engine.stats()["fence_waits"] == before
