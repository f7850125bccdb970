"""The model's own PyTorch API on a model strata holds: model.state_dict(), model.load_state_dict(), parameters
read outside forward, and engine.gathered()."""

import copy
import io

import pytest
import torch
import torch.nn.functional as F

import strata
from models import TinyGPT, batches, holds_no_storage, mixed_precision_losses, pair, strata_losses, three_tiers

# Budgets that put TinyGPT's param chunks on all three tiers (its bf16 params take 64KiB).
TIERS = {"fp32": {}, "bf16": {"device": {"budget": 32 * 1024}, "host": {"budget": 96 * 1024}}}


def held_engine(tmp_path, model, precision="fp32"):
    return strata.initialize(model, three_tiers(tmp_path, precision=precision, **TIERS[precision]))


def plain_losses(model, data, opt):
    """Plain PyTorch training with a given optimizer (kept by the caller across calls)."""
    losses = []
    for tokens in data:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses


def norm_error(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def assert_values(state, expected, tolerance):
    assert list(state) == list(expected)
    for name, value in expected.items():
        assert state[name].shape == value.shape and state[name].dtype == value.dtype, name
        assert norm_error(state[name], value) <= tolerance, name


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_models_state_dict_is_plain_pytorchs_after_training(tmp_path, precision):
    model, reference = pair()
    engine = held_engine(tmp_path, model, precision)
    data = batches(3)
    strata_losses(engine, data)
    tiers = engine.chunk_tiers()
    assert {"device", "nvme"} <= set(tiers["param"]) and "host" in {t for kind in tiers.values() for t in kind}
    if precision == "fp32":
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        plain_losses(reference, data, opt)
    else:  # the mixed-precision recipe leaves the reference in bf16
        mixed_precision_losses(reference, data)
    # The chunks state_dict reads are read where they are: none moves. (The optimizer's moments may still be on
    # their way back to NVMe from the last update, a write-back that ends when it ends.)
    read = lambda: {kind: tiers for kind, tiers in engine.chunk_tiers().items() if kind in ("param", "master")}  # noqa: E731
    tiers = read()
    state = model.state_dict()
    assert read() == tiers
    # torch's keys in torch's order (the tied head.weight and wte.weight both), shapes and dtypes.
    assert_values(state, reference.state_dict(), 1e-5 if precision == "fp32" else 2e-2)
    assert state["head.weight"] is state["wte.weight"]
    registered = engine.state_dict()
    assert all(torch.equal(state[name], value) for name, value in registered.items())
    # A submodule's state dict, under its own prefix.
    block = model.blocks[1].state_dict()
    assert list(block) == list(reference.blocks[1].state_dict())
    assert torch.equal(block["up.weight"], registered["blocks.1.up.weight"])
    # keep_vars=True gives the parameters themselves, as torch does.
    assert model.state_dict(keep_vars=True)["blocks.0.qkv.weight"] is model.blocks[0].qkv.weight


def test_a_saved_state_dict_loads_into_a_plain_model_that_computes_the_same(tmp_path):
    model, _ = pair()
    engine = held_engine(tmp_path, model)
    strata_losses(engine, batches(2))
    saved = io.BytesIO()
    torch.save(model.state_dict(), saved)
    saved.seek(0)
    torch.manual_seed(7)
    plain = TinyGPT()
    plain.load_state_dict(torch.load(saved))
    tokens = batches(1, seed=5)[0][:, :-1]
    with torch.no_grad():
        assert torch.allclose(model(tokens), plain(tokens), rtol=1e-6, atol=1e-6)


def test_load_state_dict_changes_training_as_it_does_a_plain_models(tmp_path):
    """Loaded after 2 steps (the optimizer's moments kept, as torch.optim keeps them): the next 5 steps' losses
    are plain PyTorch's."""
    model, reference = pair()
    engine = held_engine(tmp_path, model)
    data = batches(7)
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    strata_losses(engine, data[:2])
    plain_losses(reference, data[:2], opt)
    torch.manual_seed(3)
    other = TinyGPT().state_dict()
    assert str(model.load_state_dict(other)) == str(reference.load_state_dict(other)) == "<All keys matched successfully>"
    assert all(torch.equal(model.state_dict()[name], value) for name, value in other.items())
    ours, theirs = strata_losses(engine, data[2:]), plain_losses(reference, data[2:], opt)
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)


def test_load_state_dict_sets_the_fp32_masters_from_the_values_given(tmp_path):
    model, _ = pair()
    engine = held_engine(tmp_path, model, "bf16")
    torch.manual_seed(3)
    other = TinyGPT().state_dict()  # fp32
    model.load_state_dict(other)
    masters = engine.state_dict(master=True)
    assert all(torch.equal(masters[name], other[name]) for name in masters)
    assert all(torch.equal(value, other[name].bfloat16()) for name, value in model.state_dict().items())


class Normed(torch.nn.Module):
    """Buffers beside parameters: a BatchNorm's running statistics."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(8, 16)
        self.norm = torch.nn.BatchNorm1d(16)
        self.last = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.last(self.norm(self.first(x)))


def normed_engine(tmp_path, precision):
    torch.manual_seed(0)
    model = Normed()
    model.norm.to(torch.bfloat16 if precision == "bf16" else torch.float32)  # its statistics in the compute dtype
    engine = strata.initialize(model, three_tiers(tmp_path, precision=precision))
    x = torch.randn(6, 8, dtype=engine.dtype)
    engine.backward(engine(x).sum())  # a training forward updates the running statistics
    engine.step()
    return model, engine


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_load_torch_refuses_changes_nothing(tmp_path, precision):
    model, engine = normed_engine(tmp_path, precision)
    before = {name: value.clone() for name, value in model.state_dict().items()}  # buffers are the model's own
    masters = engine.state_dict(master=True)
    torch.manual_seed(1)
    other = Normed().state_dict()  # other values everywhere, buffers included
    wrong = dict(other, **{"last.weight": torch.zeros(4, 15)})
    with pytest.raises(RuntimeError, match=r"size mismatch for last.weight: copying a param with shape "
                                           r"torch.Size\(\[4, 15\]\) from checkpoint, the shape in current model "
                                           r"is torch.Size\(\[4, 16\]\)"):
        model.load_state_dict(wrong)
    missing = {k: v for k, v in other.items() if k != "first.bias"}
    with pytest.raises(RuntimeError, match=r'Missing key\(s\) in state_dict: "first.bias"'):
        model.load_state_dict(missing)
    with pytest.raises(RuntimeError, match=r'Unexpected key\(s\) in state_dict: "extra"'):
        model.load_state_dict(dict(other, extra=torch.zeros(1)))
    with pytest.raises(ValueError, match="assign=False"):
        model.load_state_dict(other, assign=True)
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())  # buffers too
    assert all(torch.equal(engine.state_dict(master=True)[name], value) for name, value in masters.items())
    # strict=False: the rest loads, what is missing stays, torch's answer.
    result = model.load_state_dict(missing, strict=False)
    assert (result.missing_keys, result.unexpected_keys) == (["first.bias"], [])
    after = model.state_dict()
    assert torch.equal(after["first.bias"], before["first.bias"])
    assert all(torch.equal(after[name], value.to(after[name].dtype)) for name, value in missing.items())


def test_a_parameter_read_outside_forward_fails_naming_gathered(tmp_path):
    model, _ = pair()
    engine = held_engine(tmp_path, model)
    p = model.blocks[0].qkv.weight
    assert (p.shape, p.dtype, p.numel(), p.requires_grad, p.grad) == (torch.Size([96, 32]), torch.float32, 3072,
                                                                       True, None)
    assert isinstance(p, torch.nn.Parameter) and holds_no_storage(p)
    reads = [p.sum, p.tolist, lambda: print(p), lambda: torch.save(p, io.BytesIO()), lambda: p.detach().sum(),
             lambda: p.data, lambda: F.linear(torch.randn(2, 32), p), lambda: p.copy_(torch.zeros(96, 32))]
    for read in reads:
        with pytest.raises(RuntimeError, match=r"'blocks.0.qkv.weight' is held by a strata engine.*"
                                               r"engine.gathered\(\).*model.state_dict\(\)"):
            read()
    for whole in (lambda: copy.deepcopy(model), lambda: model.to(torch.float64)):
        with pytest.raises(RuntimeError, match="is held by a strata engine"):
            whole()
    # Forward and backward still read the real values.
    strata_losses(engine, batches(1))
    assert holds_no_storage(p)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_edits_inside_gathered_persist_and_train(tmp_path, precision):
    model, reference = pair()
    engine = held_engine(tmp_path, model, precision)
    masters = engine.state_dict(master=True)
    new_bias = torch.randn(32)

    def edit(m):
        with torch.no_grad():
            m.blocks[0].up.weight.mul_(0.5)
            m.blocks[1].proj.bias.copy_(new_bias)
        torch.nn.init.zeros_(m.ln_f.bias)
        return m.blocks[0].up.weight.sum().item()

    with engine.gathered():
        assert not holds_no_storage(model.blocks[0].up.weight)
        edited = edit(model)
    assert edited == pytest.approx(edit(reference), rel=1e-2 if precision == "bf16" else 1e-6)
    assert holds_no_storage(model.blocks[0].up.weight)
    after = engine.state_dict(master=True)
    for name, value in masters.items():
        if name not in ("blocks.0.up.weight", "blocks.1.proj.bias", "ln_f.bias"):
            assert torch.equal(after[name], value), name  # untouched: its fp32 master kept, bit for bit
    assert torch.equal(after["ln_f.bias"], torch.zeros(32))
    compute = torch.bfloat16 if precision == "bf16" else torch.float32
    assert torch.equal(after["blocks.1.proj.bias"], new_bias.to(compute).float())
    assert torch.equal(model.state_dict()["blocks.0.up.weight"], (masters["blocks.0.up.weight"].to(compute) * 0.5))
    if precision == "fp32":
        data = batches(3)
        opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
        ours, theirs = strata_losses(engine, data), plain_losses(reference, data, opt)
        assert max(abs(a - b) / b for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)


def test_gathered_holds_what_it_is_given_and_nothing_runs_inside(tmp_path):
    model, _ = pair()
    engine = held_engine(tmp_path, model)
    tokens = batches(1)[0]
    with engine.gathered(model.blocks[1]):
        assert not holds_no_storage(model.blocks[1].down.weight)
        with pytest.raises(RuntimeError, match="blocks.0.up.weight"):
            model.blocks[0].up.weight.sum()
        with pytest.raises(RuntimeError, match=r"engine.gathered\(\) is open"):
            model(tokens[:, :-1], tokens[:, 1:])
        with pytest.raises(RuntimeError, match=r"engine.gathered\(\) is open"):
            with engine.gathered():
                pass
        # model.state_dict() inside: the values as they are there.
        with torch.no_grad():
            model.blocks[1].down.bias.fill_(2.0)
        assert torch.equal(model.state_dict()["blocks.1.down.bias"], torch.full((32,), 2.0))
    with engine.gathered([model.wpe, model.ln_f]):
        assert model.wpe.sum().item() != 0 and model.ln_f.weight.sum().item() == 32
    with pytest.raises(ValueError, match="not a parameter of the model"):
        with engine.gathered(torch.nn.Linear(2, 2)):
            pass
    assert all(holds_no_storage(p) for p in model.parameters())
    # A .data of another shape is refused on leaving, nothing written.
    before = model.state_dict()
    with pytest.raises(ValueError, match=r"ln_f.bias is \[3\]"):
        with engine.gathered(model.ln_f):
            model.ln_f.weight.data.fill_(0.0)
            model.ln_f.bias.data = torch.zeros(3)
    assert all(torch.equal(model.state_dict()[name], value) for name, value in before.items())
    strata_losses(engine, batches(1))  # trains on


def test_a_model_built_on_the_meta_device_gives_its_weights_back(tmp_path):
    torch.manual_seed(0)
    weights = TinyGPT().state_dict()
    with torch.device("meta"):
        model = TinyGPT()
    strata.initialize(model, three_tiers(tmp_path), weights=weights)
    state = model.state_dict()
    assert list(state) == list(weights) and all(torch.equal(state[name], weights[name]) for name in weights)
