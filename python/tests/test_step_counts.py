"""PyTorch's step semantics per parameter: a model that skips blocks in some steps (LayerDrop, stochastic
depth, experts no token reached) trains through strata as through torch.optim, where a parameter whose
.grad is None is left out of the step entirely: moments, weight decay and its own step count."""

import copy

import pytest
import torch

import strata
from models import relative_errors, three_tiers

BLOCKS, HIDDEN, STEPS = 6, 32, 10


class LayerDrop(torch.nn.Module):
    """Residual blocks, each run or skipped as the step's mask says, and a head."""

    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(HIDDEN, HIDDEN) for _ in range(BLOCKS))
        self.head = torch.nn.Linear(HIDDEN, 1)

    def forward(self, x, keep):
        for block, kept in zip(self.blocks, keep):
            if kept:
                x = x + torch.tanh(block(x))
        return self.head(x).pow(2).mean()


def masks(steps=STEPS):
    """Which blocks each step runs: random, but block 0 sits out the first step and block 1 the first three,
    so that their first updates come at steps 2 and 4."""
    generator = torch.Generator().manual_seed(3)
    out = [(torch.rand(BLOCKS, generator=generator) > 0.35).tolist() for _ in range(steps)]
    out[0][0] = False
    for step in range(3):
        out[step][1] = False
    return out


def inputs(steps=STEPS):
    generator = torch.Generator().manual_seed(5)
    return [torch.randn(8, HIDDEN, generator=generator) for _ in range(steps)]


OPTIMIZERS = {
    "adamw": ({"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
              lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)),
    "adam": ({"type": "adam", "lr": 1e-2, "weight_decay": 0.01},
             lambda params: torch.optim.Adam(params, lr=1e-2, weight_decay=0.01)),
    "sgd": ({"type": "sgd", "lr": 1e-2, "weight_decay": 0.01, "momentum": 0.9},
            lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, weight_decay=0.01)),
    # Dampening tells a parameter's first update (its buffer starts as the gradient) from a later one.
    "sgd_dampening": ({"type": "sgd", "lr": 1e-2, "weight_decay": 0.01, "momentum": 0.9, "dampening": 0.5},
                      lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9, dampening=0.5,
                                                     weight_decay=0.01)),
}


def pair():
    torch.manual_seed(0)
    model = LayerDrop()
    return model, copy.deepcopy(model)


def torch_run(model, kind, data, keep):
    opt = OPTIMIZERS[kind][1](model.parameters())
    losses = []
    for x, mask in zip(data, keep):
        loss = model(x, mask)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def strata_run(engine, data, keep):
    losses = []
    for x, mask in zip(data, keep):
        loss = engine(x, mask)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def assert_same_parameters(engine, reference):
    state = engine.state_dict()
    for name, value in reference.state_dict().items():
        assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-7), name


def config(nvme_dir, kind):
    # The blocks share chunks: chunk-mates with different step counts.
    nvme_dir.mkdir(exist_ok=True)
    return three_tiers(nvme_dir, optimizer=OPTIMIZERS[kind][0])


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_blocks_skipped_per_step_train_as_in_torch(tmp_path, kind):
    model, reference = pair()
    engine = strata.initialize(model, config(tmp_path, kind))
    shared = [c for c in engine.engine.chunks() if c["kind"] == "param" and len(c["tensors"]) > 2]
    assert shared, "the test means blocks to share a chunk"
    data, keep = inputs(), masks()
    ours = strata_run(engine, data, keep)
    theirs = torch_run(reference, kind, data, keep)
    assert max(relative_errors(ours, theirs)) <= 1e-5, (ours, theirs)
    assert_same_parameters(engine, reference)
    assert engine.stats()["steps"] == STEPS


def test_a_checkpoint_mid_training_keeps_each_parameters_step_count(tmp_path):
    model, reference = pair()
    data, keep = inputs(), masks()
    first = strata.initialize(model, config(tmp_path / "first", "adamw"))
    ours = strata_run(first, data[:5], keep[:5])
    first.save_checkpoint(tmp_path / "ckpt")
    torch.manual_seed(1)  # another model's values: the checkpoint's must replace them
    second = strata.initialize(LayerDrop(), config(tmp_path / "second", "adamw"))
    assert second.load_checkpoint(tmp_path / "ckpt")["step"] == 5
    ours += strata_run(second, data[5:], keep[5:])
    theirs = torch_run(reference, "adamw", data, keep)
    assert max(relative_errors(ours, theirs)) <= 1e-5, (ours, theirs)
    assert_same_parameters(second, reference)
