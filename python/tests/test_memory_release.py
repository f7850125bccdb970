"""Memory that comes back: close() gives every tier's memory and files back at once, engine after engine in
one process stays flat, and host.budget auto sizes the host tier to the model.

RSS is the process's VmRSS. The first engine of a process pays once for what no close can give back (torch's
autograd engine and thread pools, the pages of strata's extension that run): each test trains a warm-up engine
first, as a sweep's or a notebook's first cell does, and measures from there. No test calls gc.collect(): close()
alone must give the memory back.
"""

import pytest
import torch

import strata

MiB = 1 << 20
# What RSS may differ by where nothing is kept: Python's and torch's own allocations between two readings.
SLACK_BYTES = 4 * MiB
WIDTH = 512  # the MLP below: 1M parameters, 16 MiB of fp32 params, grads and Adam moments


def rss_bytes():
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmRSS in /proc/self/status")


def mlp(width=WIDTH):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(width, 2 * width), torch.nn.ReLU(), torch.nn.Linear(2 * width, width))


CONFIG = {"log": {"level": "warning"}}  # the defaults otherwise: host.budget auto


def train(engine, batch, steps=2):
    for _ in range(steps):
        engine.backward(engine(batch).square().mean())
        engine.step()


def one_engine(batch):
    """A sweep's or a notebook's cell: a fresh model trained a little, the engine closed by the with block."""
    with strata.initialize(mlp(), CONFIG) as engine:
        train(engine, batch)


@pytest.fixture(scope="module")
def batch():
    warm = torch.randn(8, WIDTH)
    one_engine(warm)  # the process's one-time costs
    return warm


def test_close_gives_the_memory_back(batch):
    model = mlp()
    before = rss_bytes()
    engine = strata.initialize(model, CONFIG)
    train(engine, batch)
    states = sum(c["size_bytes"] for c in engine.engine.chunks())
    during = rss_bytes()
    assert during - before >= states // 2, f"the engine's memory does not show: {(during - before) / MiB:.1f} MiB"
    engine.close()
    after = rss_bytes()
    assert after - before <= SLACK_BYTES, (f"RSS {before / MiB:.1f} MiB before initialize, {during / MiB:.1f} "
                                           f"training, {after / MiB:.1f} after close")


def test_twenty_engines_one_after_another_stay_flat(batch):
    after_each = []
    for _ in range(20):
        one_engine(batch)
        after_each.append(rss_bytes())
    growth = after_each[-1] - after_each[0]
    assert growth <= SLACK_BYTES, f"RSS after each close (MiB): {[round(b / MiB, 1) for b in after_each]}"


def test_the_default_host_budget_is_what_the_model_needs():
    # The 4K-parameter model of the issue: its host tier was a 4 GiB arena.
    with strata.initialize(mlp(32), CONFIG) as engine:
        assert engine.config.options.describe()["host.budget"] == "auto"
        chunks = engine.engine.chunks()
        capacity = engine.engine.stats()["tiers"]["host"]["capacity_bytes"]
    states = sum(c["size_bytes"] for c in chunks)
    largest = max(c["size_bytes"] for c in chunks)
    eighth = -(-states // 8 // 4096) * 4096  # an eighth more, in whole 4 KiB slots
    assert capacity == states + eighth + 2 * largest
    assert capacity < MiB


def four_layers(available_bytes, **keys):
    """The C++ engine, host.budget auto, told the machine has `available_bytes`; four layers of 1 MiB states."""
    config = {"device": {"backend": "emulated", "budget": "1MiB"}, "log": {"level": "warning"}, **keys}
    engine = strata.Engine(strata.load_config(config).options, available_host_bytes=available_bytes)
    for layer in range(4):
        engine.register_tensor(f"layer{layer}", [16384], "fp32", True, f"l{layer}")
    return engine


def test_states_beyond_half_the_available_memory_go_to_nvme_or_are_refused_with_the_figures(tmp_path):
    alone = four_layers(MiB)
    with pytest.raises(MemoryError, match=r"host.budget auto takes at most half the memory available now, 512KiB.*"
                                          r"model states need 1MiB.*add nvme.dirs"):
        alone.finalize()
    spilled = four_layers(MiB, nvme={"dirs": [str(tmp_path)]})
    spilled.finalize()
    assert spilled.stats()["tiers"]["host"]["capacity_bytes"] == 512 << 10
    assert any(c["home"] == "nvme" for c in spilled.chunks())
    spilled.close()


def test_with_nvme_the_host_tier_and_rss_are_what_the_model_needs(tmp_path, batch):
    # Registered with io_uring, the host arena is all resident at once (Note [Host budget auto]): its size is its cost.
    # The static policy with no states on the host sends them to NVMe however small the model; the machine is told
    # it has 2 GiB, so a host tier of the whole cap would be 1 GiB resident.
    before = rss_bytes()
    engine = four_layers(2 << 30, placement={"policy": "static", "host_states": 0}, nvme={"dirs": [str(tmp_path)]})
    engine.finalize()
    capacity = engine.stats()["tiers"]["host"]["capacity_bytes"]
    grown = rss_bytes() - before
    assert any(c["home"] == "nvme" for c in engine.chunks())
    assert capacity <= 2 * MiB, f"host tier {capacity / MiB:.1f} MiB for 1 MiB of params and grads"
    assert grown <= capacity + SLACK_BYTES, f"RSS grew {grown / MiB:.1f} MiB, host tier {capacity / MiB:.1f} MiB"
    engine.close()
    # Through initialize, on this machine's own memory: the host tier, all resident, and the params' first copy on
    # the device, bounded by the model's states, not half the machine.
    before = rss_bytes()
    with strata.initialize(mlp(), {**CONFIG, "nvme": {"dirs": [str(tmp_path)]}}) as engine:
        grown = rss_bytes() - before
        states = sum(c["size_bytes"] for c in engine.engine.chunks())
        capacity = engine.engine.stats()["tiers"]["host"]["capacity_bytes"]
        train(engine, batch, steps=1)
    assert capacity <= 2 * states
    assert grown <= capacity + states + SLACK_BYTES, (f"RSS grew {grown / MiB:.1f} MiB for {states / MiB:.1f} MiB of "
                                                      f"states, host tier {capacity / MiB:.1f} MiB")


def test_close_is_final_idempotent_and_removes_the_nvme_files(tmp_path, batch):
    model = mlp()
    config = {**CONFIG, "nvme": {"dirs": [str(tmp_path)]}}
    with strata.initialize(model, config) as engine:
        train(engine, batch)
        state = engine.state_dict()
        assert list(tmp_path.iterdir())  # the NVMe tier's file
    assert not list(tmp_path.iterdir())
    engine.close()  # again: nothing to do
    for use in (lambda: engine.step(), lambda: engine.stats(), lambda: engine.state_dict(), lambda: engine.engine,
                lambda: engine.backward(torch.ones(())), lambda: engine(batch), lambda: model(batch),
                lambda: model.state_dict(), lambda: model[0].state_dict(), lambda: model.load_state_dict(state)):
        with pytest.raises(RuntimeError, match=r"the engine was closed \(engine.close\(\)\)"):
            use()
    assert set(state) == {name for name, _ in model.named_parameters()}


def test_a_with_block_that_raises_closes_its_engine(batch):
    with pytest.raises(ZeroDivisionError):
        with strata.initialize(mlp(), CONFIG) as engine:
            train(engine, batch, steps=1)
            raise ZeroDivisionError
    with pytest.raises(RuntimeError, match="closed"):
        engine.step()
