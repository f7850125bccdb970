"""Room on the device (issue 22): reusing a module pins no more than calling it once, and odd-sized chunks do not
split a tight device tier; a budget that cannot hold one moment's chunks is refused with the figures."""

import copy

import pytest
import torch

import strata


class Reused(torch.nn.Module):
    """a, b, then a again (when `twice`): one Linear called twice in a forward."""

    def __init__(self, twice, width=64):
        super().__init__()
        self.twice = twice
        self.a, self.b, self.out = torch.nn.Linear(width, width), torch.nn.Linear(width, width), torch.nn.Linear(width, 1)

    def forward(self, x):
        x = torch.tanh(self.b(torch.tanh(self.a(x))))
        if self.twice:
            x = torch.tanh(self.a(x))
        return self.out(x).pow(2).mean()


class OddLayers(torch.nn.Module):
    """Five Linear layers wider than the chunk size: each weight in a chunk of its own, of its own size."""

    def __init__(self, widths=(64, 96, 80, 112, 72, 16)):
        super().__init__()
        layers = []
        for i in range(len(widths) - 1):
            layers += [torch.nn.Linear(widths[i], widths[i + 1]), torch.nn.Tanh()]
        self.body = torch.nn.Sequential(*layers[:-1])

    def forward(self, x):
        return self.body(x).pow(2).mean()


def config(tmp_path, device_budget, chunk_elems):
    return {"optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
            "device": {"backend": "emulated", "budget": device_budget}, "host": {"budget": "4MiB"},
            "nvme": {"dirs": [str(tmp_path)], "capacity": "16MiB"}, "chunk": {"size_elems": chunk_elems},
            "non_model_memory": 0, "log": {"level": "error"}}


def train_both(model, cfg, inputs, steps=6):
    """(strata's losses, torch's losses, the engine) of the same model trained by both."""
    torch.manual_seed(0)
    reference = copy.deepcopy(model)
    engine = strata.initialize(model, cfg)
    optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    generator = torch.Generator().manual_seed(1)
    ours, theirs = [], []
    for _ in range(steps):
        x = torch.randn(8, inputs, generator=generator)
        loss = engine(x)
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
        loss = reference(x)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        theirs.append(loss.item())
    return ours, theirs, engine


def assert_same_within(ours, theirs, engine, budget):
    assert max(abs(a - b) / abs(b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)
    assert engine.stats()["tiers"]["device"]["peak_bytes"] <= budget


@pytest.mark.parametrize("twice", [False, True])
def test_a_module_called_twice_trains_within_the_budget_of_one_call(tmp_path, twice):
    # One chunk per Linear (4096 + 64 elements): a moment pins a parameter
    # chunk and its gradient chunk, 40KiB, called once or twice.
    torch.manual_seed(0)
    budget = 40 * 1024
    ours, theirs, engine = train_both(Reused(twice), config(tmp_path, budget, 4096 + 65), 64)
    assert_same_within(ours, theirs, engine, budget)


@pytest.mark.parametrize("share", [0.3, 0.25, 0.2])
def test_odd_sized_chunks_train_in_a_tight_device_tier(tmp_path, share):
    torch.manual_seed(0)
    model = OddLayers()
    model_states = sum(p.numel() for p in model.parameters()) * 4 * 4  # fp32 param, grad and two moments
    budget = int(model_states * share)
    ours, theirs, engine = train_both(model, config(tmp_path, budget, 1024), 64)
    assert_same_within(ours, theirs, engine, budget)


# OddLayers' largest moment: the backward of its third layer pins its weight
# and that weight's gradient (36KiB each) and the chunk of every bias and
# its gradient (4KiB each).
LARGEST_MOMENT_BYTES = 80 * 1024


def test_every_budget_trains_from_the_largest_moment_up_and_is_refused_with_the_figures_below(tmp_path):
    # Before room was made at the pins (Note [Pins against pins]), budgets of
    # 72-88KiB and 132KiB failed on room in pieces.
    model_states = sum(p.numel() for p in OddLayers().parameters()) * 4 * 4
    for budget in range(40 * 1024, int(model_states * 0.3), 4096):
        torch.manual_seed(0)
        (tmp_path / str(budget)).mkdir()
        cfg = config(tmp_path / str(budget), budget, 1024)
        if budget >= LARGEST_MOMENT_BYTES:
            assert_same_within(*train_both(OddLayers(), cfg, 64, steps=4), budget)
            continue
        with pytest.raises(MemoryError, match=r"the chunks one moment uses at once need \d+KiB of the tier's "
                                              r"\d+KiB; raise device.budget to at least \d+KiB"):
            train_both(OddLayers(), cfg, 64, steps=1)


@pytest.mark.parametrize("share, needed", [(0.15, "80KiB"), (48 * 1024, "72KiB")])
def test_a_budget_below_one_moments_chunks_is_refused_with_the_figures(tmp_path, share, needed):
    torch.manual_seed(0)
    model = OddLayers()
    budget = share if share > 1 else int(sum(p.numel() for p in model.parameters()) * 4 * 4 * share)
    capacity = f"{budget // 4096 * 4}KiB"
    with pytest.raises(MemoryError, match=rf"the chunks one moment uses at once need {needed} of the tier's "
                                          rf"{capacity}; raise device.budget to at least {needed}"):
        train_both(model, config(tmp_path, budget, 1024), 64, steps=1)
