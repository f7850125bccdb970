"""strata.initialize against plain PyTorch: the same losses, within the budgets, on all three tiers."""

import copy
import os

import pytest
import torch

import strata
from models import (DEVICE_BUDGET, HOST_BUDGET, TinyGPT, batches, holds_no_storage, mixed_precision_losses, pair,
                    relative_errors, strata_losses, three_tiers, torch_losses)

def tiers_used(engine):
    """Tiers holding some chunk's home."""
    return {chunk["home"] for chunk in engine.engine.chunks()}


def test_fp32_adamw_matches_torch_for_20_steps_on_three_tiers(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    data = batches(20)
    ours = strata_losses(engine, data)
    theirs = torch_losses(reference, data)
    assert max(relative_errors(ours, theirs)) <= 1e-5, (ours, theirs)
    assert ours[-1] < ours[0]  # it trains
    state = engine.state_dict()
    for name, value in reference.state_dict().items():
        if name in state:
            assert torch.allclose(state[name], value, rtol=1e-5, atol=1e-6), name
    assert tiers_used(engine) == {"host", "nvme"}
    stats = engine.stats()
    assert stats["pipeline"]["planned_iterations"] >= 18  # the trace replays: one warm-up, then the plan
    assert stats["pipeline"]["divergences"] == 0
    assert stats["links"]["nvme->host"]["bytes"] > 0 and stats["links"]["host->nvme"]["bytes"] > 0
    assert stats["steps"] == 20


@pytest.mark.parametrize("kind", ["adam", "sgd"])
def test_adam_and_sgd_match_torch(tmp_path, kind):
    model, reference = pair()
    config = three_tiers(tmp_path, optimizer={"type": kind, "lr": 1e-2, "weight_decay": 0.01, "momentum": 0.9})
    if kind == "adam":
        del config["optimizer"]["momentum"]
    engine = strata.initialize(model, config)
    data = batches(8)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data, optimizer=kind))) <= 1e-5


def test_bf16_matches_the_mixed_precision_recipe_and_stays_near_fp32(tmp_path):
    model, reference = pair()
    fp32_reference = copy.deepcopy(reference)
    engine = strata.initialize(model, three_tiers(tmp_path, precision="bf16"))  # fp32 values become the masters
    data = batches(20)
    ours = strata_losses(engine, data)
    recipe = mixed_precision_losses(reference, data)
    fp32 = torch_losses(fp32_reference, data)
    # Same bf16 forward from the same fp32 masters: only the rounding of the
    # update (strata's fused kernel against torch's) differs, and it flips a
    # bf16 weight only at a rounding boundary (2^-9 relative).
    assert max(relative_errors(ours, recipe)) <= 2e-3, (ours, recipe)
    # Against fp32: bf16 keeps 8 significant bits (2^-9 relative rounding per
    # value), and training moves the two runs apart as it amplifies those
    # differences: 20 steps measured 1.7e-2. The strict check is the one above.
    assert max(relative_errors(ours, fp32)) <= 3e-2, (ours, fp32)
    assert any(chunk["kind"] == "master" for chunk in engine.engine.chunks())
    assert engine.state_dict()["wte.weight"].dtype == torch.bfloat16
    assert engine.state_dict(master=True)["wte.weight"].dtype == torch.float32


def test_tied_parameters_are_registered_once(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    names = list(engine.state_dict())
    assert "wte.weight" in names and "head.weight" not in names
    assert model.head.weight is model.wte.weight


def test_frozen_parameters_get_no_grad_and_no_state_and_do_not_change(tmp_path):
    model, reference = pair()
    for m in (model, reference):
        m.wte.weight.requires_grad_(False)
        m.blocks[0].qkv.weight.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine = strata.initialize(model, three_tiers(tmp_path))
    frozen_ids = {i for i, name in enumerate(engine.state_dict()) if name in ("wte.weight", "blocks.0.qkv.weight")}
    for chunk in engine.engine.chunks():
        if chunk["kind"] != "param":
            assert not frozen_ids & set(chunk["tensors"]), chunk
    data = batches(6)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5
    state = engine.state_dict()
    assert torch.equal(state["wte.weight"], before["wte.weight"])
    assert torch.equal(state["blocks.0.qkv.weight"], before["blocks.0.qkv.weight"])
    assert not torch.equal(state["blocks.0.proj.weight"], before["blocks.0.proj.weight"])


def test_gradient_accumulation_matches_torch(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path, gradient_accumulation_steps=4))
    data = batches(12)
    ours = []
    stepped = []
    for tokens in data:
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        stepped.append(engine.step())
        ours.append(loss.item())
    assert stepped == [False, False, False, True] * 3
    assert engine.stats()["steps"] == 3
    assert max(relative_errors(ours, torch_losses(reference, data, accumulation=4))) <= 1e-5


@pytest.mark.parametrize("checkpoint", [True, "non_reentrant"])
def test_activation_checkpointing_matches_torch(tmp_path, checkpoint):
    model, reference = pair(checkpoint=checkpoint)
    engine = strata.initialize(model, three_tiers(tmp_path))
    data = batches(6)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5


def test_gradient_clipping_matches_torch(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path, gradient_clipping=0.5))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    ours, theirs = [], []
    for tokens in batches(6):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        ours.append(loss.item())
        ref = reference(tokens[:, :-1], tokens[:, 1:])
        ref.backward()
        norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        opt.step()
        opt.zero_grad()
        theirs.append(ref.item())
        assert engine.stats()["last_step"]["grad_norm"] == pytest.approx(norm.item(), rel=1e-4)
    assert max(relative_errors(ours, theirs)) <= 1e-5


def test_eval_and_no_grad_passes_between_steps(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    held_out = batches(1, seed=7)[0]
    for tokens in batches(4):
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
        ref = reference(tokens[:, :-1], tokens[:, 1:])
        ref.backward()
        opt.step()
        opt.zero_grad()
        assert loss.item() == pytest.approx(ref.item(), rel=1e-5)
        engine.eval()
        with torch.no_grad():
            ours = engine(held_out[:, :-1])
            theirs = reference.eval()(held_out[:, :-1])
        assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5)
        engine.train()
        reference.train()
        with torch.no_grad():  # no_grad in training mode too
            assert engine(held_out[:, :-1], held_out[:, 1:]).item() == pytest.approx(
                reference(held_out[:, :-1], held_out[:, 1:]).item(), rel=1e-5)
    # The evaluation passes ran outside the pipeline: the plan kept replaying.
    assert engine.stats()["pipeline"]["divergences"] == 0


def test_a_parameter_larger_than_the_chunk_size(tmp_path):
    model, reference = pair(hidden=48)  # qkv.weight: 6912 elements, up/down: 9216, against 2048-element chunks
    engine = strata.initialize(model, three_tiers(tmp_path, device={"budget": "256KiB"}, host={"budget": "1MiB"}))
    sizes = {chunk["id"]: chunk["size_bytes"] for chunk in engine.engine.chunks() if chunk["kind"] == "param"}
    assert max(sizes.values()) > 2048 * 4
    data = batches(5)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5


def test_parameters_hold_no_storage_outside_their_module(tmp_path):
    model, _ = pair()
    strata.initialize(model, three_tiers(tmp_path))
    assert all(holds_no_storage(p) for p in model.parameters())
    seen = []
    model.blocks[0].qkv.register_forward_pre_hook(lambda m, i: seen.append(m.weight.shape))
    tokens = batches(1)[0]
    model(tokens[:, :-1], tokens[:, 1:]).backward()
    assert seen == [torch.Size([96, 32])]
    assert all(holds_no_storage(p) and p.grad is None for p in model.parameters())


def test_budgets_hold(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    chunks = engine.engine.chunks()
    param_bytes = sum(c["size_bytes"] for c in chunks if c["kind"] == "param")
    state_bytes = sum(c["size_bytes"] for c in chunks if c["kind"] in ("master", "exp_avg", "exp_avg_sq"))
    assert DEVICE_BUDGET < param_bytes and HOST_BUDGET < state_bytes
    strata_losses(engine, batches(5))
    tiers = engine.stats()["tiers"]
    assert 0 < tiers["device"]["peak_bytes"] <= DEVICE_BUDGET
    assert 0 < tiers["host"]["peak_bytes"] <= HOST_BUDGET
    assert tiers["nvme"]["peak_bytes"] > 0


def test_stats_and_timeline(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    strata_losses(engine, batches(3))
    stats = engine.stats()
    assert set(stats["tiers"]) == {"device", "host", "nvme"}
    assert stats["last_step"]["groups"] > 0 and stats["last_step"]["seconds"] > 0
    assert stats["stall_seconds"] >= 0
    timeline = stats["timeline"]
    # Every forward and backward moment, and the tiers after the step.
    assert len(timeline) == stats["pipeline"]["plan"]["moments"] - stats["last_step"]["groups"] + 1
    assert max(moment["device"] for moment in timeline) <= DEVICE_BUDGET
    assert sum(stats["chunk_tiers"]["param"].values()) == sum(
        c["size_bytes"] for c in engine.engine.chunks() if c["kind"] == "param")


def saved_activation_bytes(model, tokens):
    """The most bytes autograd holds for backward during one forward of plain PyTorch."""
    held = []

    def pack(tensor):
        held.append(tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(tokens[:, :-1], tokens[:, 1:])
    return sum(held)


def test_activations_beyond_the_emulated_device_still_get_a_plan(tmp_path):
    model, reference = pair()
    config = three_tiers(tmp_path)
    del config["non_model_memory"]  # measured: none on the emulated device, whose tier holds chunks only
    data = batches(4)
    assert saved_activation_bytes(copy.deepcopy(reference), data[0]) > DEVICE_BUDGET
    engine = strata.initialize(model, config)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5
    pipeline = engine.stats()["pipeline"]
    assert "plan_error" not in pipeline and pipeline["plan_failures"] == 0
    assert pipeline["planned_iterations"] >= 2


def test_measured_non_model_memory_on_a_gpu_is_the_allocators_current_bytes(monkeypatch):
    """On a GPU each moment reads torch's allocated bytes from the allocator's statistics directly, not through
    memory_allocated(), which flattens all of them first (a moment per module made that 0.12 s a step)."""
    from types import SimpleNamespace

    from strata.moments import Moments
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict",
                        lambda: {"allocated_bytes": {"all": {"current": 12345, "peak": 99999}}})
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: pytest.fail("memory_allocated() was called"))
    moments = Moments(SimpleNamespace(emulated=False), None, None, None, non_model_memory=None)
    assert moments._non_model_bytes() == 12345
    assert Moments(SimpleNamespace(emulated=False), None, None, None, non_model_memory=77)._non_model_bytes() == 77


def test_a_non_model_memory_size_reaches_the_planner(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path, non_model_memory=DEVICE_BUDGET))
    data = batches(3)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5
    assert "non-model memory" in engine.stats()["pipeline"]["plan_error"]


def test_a_small_model_under_only_a_small_device_budget_trains_without_chunk_settings():
    model, reference = pair()
    engine = strata.initialize(model, {
        "optimizer": {"type": "adamw", "lr": 1e-2, "weight_decay": 0.01},
        "device": {"backend": "emulated", "budget": DEVICE_BUDGET},
        "log": {"level": "error"},
    })
    assert max(c["size_bytes"] for c in engine.engine.chunks()) <= DEVICE_BUDGET // 4
    data = batches(6)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5
    assert engine.stats()["pipeline"]["planned_iterations"] >= 4


def test_nvme_dirs_without_a_capacity_get_what_the_states_homed_there_need(tmp_path):
    model, reference = pair()
    config = three_tiers(tmp_path)
    del config["nvme"]["capacity"]
    engine = strata.initialize(model, config)
    chunks = engine.engine.chunks()
    homed = sum(chunk["size_bytes"] for chunk in chunks if chunk["home"] == "nvme")
    assert homed > 0
    largest = max(c["size_bytes"] for c in chunks)
    assert engine.stats()["tiers"]["nvme"]["capacity_bytes"] == homed + -(-homed // 8 // 4096) * 4096 + 3 * largest
    data = batches(6)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5


@pytest.mark.parametrize("config, named", [
    ({"optimizer": {"type": "lamb"}}, "optimizer.kind"),
    ({"precision": "fp8"}, "precision"),
    ({"device": {"budget": "lots"}}, "device.budget"),
    ({"non_model_memory": "some"}, "non_model_memory"),
    ({"gradient_accumulation_steps": 0}, "gradient_accumulation_steps"),
    ({"no_such_key": 1}, "no_such_key"),
])
def test_bad_configs_name_the_key(config, named):
    model, _ = pair()
    with pytest.raises(ValueError, match=named):
        strata.initialize(model, config)
    assert all(p.numel() > 0 for p in model.parameters())  # the model is left as it was


def test_a_model_that_is_not_a_module():
    with pytest.raises(TypeError, match="torch.nn.Module"):
        strata.initialize(lambda x: x, {})


def test_a_model_an_engine_holds_is_refused_by_name(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    with pytest.raises(ValueError, match="already held by a strata engine"):
        strata.initialize(model)
    child = next(iter(model.children()))
    with pytest.raises(ValueError, match="already held by a strata engine"):
        strata.initialize(child)
    parent = torch.nn.Sequential(model)  # a model that holds it
    with pytest.raises(ValueError, match="its module '0'"):
        strata.initialize(parent)
    strata_losses(engine, batches(2))  # the engine that holds it trains on
    assert engine.stats()["steps"] == 2


def test_a_corrupt_nvme_slot_is_an_exception_naming_the_chunk(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    data = batches(3)
    strata_losses(engine, data[:2])
    # Every written slot of the NVMe file, overwritten behind strata's back.
    (path,) = [os.path.join(tmp_path, name) for name in os.listdir(tmp_path)]
    used = engine.stats()["tiers"]["nvme"]["used_bytes"]
    with open(path, "r+b") as f:
        f.write(b"\x5a" * (used + 1024 * 1024))
    with pytest.raises(strata.CorruptionError, match=r"chunk \d+ holds the \w+ of"):
        strata_losses(engine, data[2:])
    # Still corrupt (a forward's read), or part of the model updated and part
    # not (a step's): either way no silent training on.
    with pytest.raises(RuntimeError, match="Corruption|cannot go on"):
        strata_losses(engine, data[2:])


class Positions(torch.nn.Module):
    """Returns a slice of its own parameter: the output is a view of chunk memory."""

    def __init__(self, seq, hidden):
        super().__init__()
        self.table = torch.nn.Parameter(torch.randn(seq, hidden) * 0.02)

    def forward(self, t):
        return self.table[:t]


class Odd(torch.nn.Module):
    """Modules the adapter must not trip on: an in-place ReLU on a Linear's output, a module
    returning a view of its parameter, a parameter no step ever reaches."""

    def __init__(self, vocab=64, hidden=32, seq=16):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.positions = Positions(seq, hidden)
        self.fc = torch.nn.Linear(hidden, hidden)
        self.act = torch.nn.ReLU(inplace=True)
        self.out = torch.nn.Linear(hidden, vocab)
        self.unused = torch.nn.Linear(hidden, hidden)

    def forward(self, tokens, targets):
        x = self.embed(tokens) + self.positions(tokens.shape[1])
        logits = self.out(self.act(self.fc(x)))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_in_place_outputs_parameter_views_and_unused_parameters_match_torch(tmp_path):
    torch.manual_seed(0)
    model = Odd()
    reference = copy.deepcopy(model)
    unused = model.unused.weight.detach().clone()
    # A device of two chunks: the positions' chunk is gone before their output is used.
    engine = strata.initialize(model, three_tiers(tmp_path, device={"budget": "32KiB"}, chunk={"size_elems": 2048}))
    data = batches(6)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5
    # torch.optim leaves a parameter without a gradient alone (no decay, no moments): so does strata.
    assert torch.equal(engine.state_dict()["unused.weight"], unused)


def test_training_in_eval_mode_matches_torch(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path)).eval()
    data = batches(4)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference.eval(), data))) <= 1e-5


def test_an_exception_in_forward_leaves_nothing_behind(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    data = batches(4)

    def fail(module, args):
        raise KeyError("from a user hook")
    handle = model.blocks[1].ln2.register_forward_pre_hook(fail)
    with pytest.raises(KeyError):
        engine(data[0][:, :-1], data[0][:, 1:])
    handle.remove()
    assert all(holds_no_storage(p) for p in model.parameters())  # nothing left pinned
    # No saved-tensor hook of strata's is left on: another model's forward and backward are its own.
    other = torch.nn.Linear(4, 4)
    other(torch.randn(2, 4)).sum().backward()
    assert engine._moments.saved_bytes == 0
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5


def test_an_exception_in_a_recomputation_in_backward_is_raised_as_it_is(tmp_path):
    model, _ = pair(checkpoint=True)  # reentrant: each block's forward runs again inside backward
    engine = strata.initialize(model, three_tiers(tmp_path))
    tokens = batches(1)[0]
    calls = []

    def fail_in_backward(module, args):
        calls.append(torch.is_grad_enabled())
        if len(calls) > 1:  # the recomputation
            raise KeyError("from a user hook, in backward")
    model.blocks[1].ln2.register_forward_pre_hook(fail_in_backward)
    loss = engine(tokens[:, :-1], tokens[:, 1:])
    with pytest.raises(KeyError, match="in backward"):
        engine.backward(loss)
    assert len(calls) == 2
    with pytest.raises(RuntimeError, match="a backward failed part way"):
        engine.step()


def test_a_configuration_refused_at_initialize_leaves_the_model_as_it_was(tmp_path):
    model, _ = pair()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    config = three_tiers(tmp_path, placement={"policy": "static", "device_params": 1.0}, host={"budget": "4MiB"})
    with pytest.raises(ValueError, match="placement.device_params"):
        strata.initialize(model, config)
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name


def test_a_host_budget_below_one_groups_update_is_refused_at_initialize(tmp_path):
    model, reference = pair()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    # A group's update holds its gradients, parameters and two Adam states in host memory at once, 64KiB for
    # the group of a 16KiB parameter, and one chunk besides for the next group's arriving.
    with pytest.raises(MemoryError, match=r"host.budget to at least 80KiB"):
        strata.initialize(model, three_tiers(tmp_path, host={"budget": "64KiB"}))
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
    engine = strata.initialize(model, three_tiers(tmp_path, host={"budget": "80KiB"}))
    data = batches(3)
    assert max(relative_errors(strata_losses(engine, data), torch_losses(reference, data))) <= 1e-5


def test_an_engine_is_freed_with_its_model(tmp_path):
    import gc
    import weakref
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    strata_losses(engine, batches(2))
    alive = weakref.ref(engine)
    del engine, model
    gc.collect()
    assert alive() is None


def test_a_released_access_is_an_empty_buffer(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    access = engine.engine.access_chunk(0, "host")
    assert memoryview(access).nbytes == access.size_bytes > 0
    access.release()
    assert memoryview(access).nbytes == 0
    with pytest.raises(ValueError):
        torch.frombuffer(access, dtype=torch.float32, count=4)


class Fit(torch.nn.Module):
    """Elementwise only: what torch 1.13 computes in fp16 on a CPU."""

    def __init__(self, n=4096):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(n))

    def forward(self, x, t):
        return ((x * self.w - t) ** 2).float().mean()


def test_fp16_with_dynamic_loss_scaling_skips_overflowing_steps_then_trains(tmp_path):
    torch.manual_seed(0)
    target = torch.randn(4096)
    inputs = [torch.randn(4096) for _ in range(30)]
    model = Fit()
    reference = copy.deepcopy(model)
    config = three_tiers(tmp_path, precision="fp16", optimizer={"type": "adamw", "lr": 0.05, "weight_decay": 0.0},
                         loss_scale={"init": 2.0 ** 40, "max": 2.0 ** 40, "growth_interval": 1000})
    engine = strata.initialize(model, config)
    opt = torch.optim.AdamW(reference.parameters(), lr=0.05, weight_decay=0.0)
    skipped, ours, theirs = 0, [], []
    for x in inputs:
        loss = engine(x.half(), (x * target).half())
        engine.backward(loss)  # scaled by 2^40 at first: the fp16 gradients overflow
        engine.step()
        last = engine.stats()["last_step"]
        if last["skipped"]:
            skipped += 1
            assert torch.equal(engine.state_dict(master=True)["w"], reference.w.detach())  # nothing moved
            continue
        ours.append(loss.item())
        ref = reference(x, x * target)
        ref.backward()
        opt.step()
        opt.zero_grad()
        theirs.append(ref.item())
    assert skipped >= 1 and engine.stats()["loss_scale"] < 2.0 ** 40  # backed off
    assert engine.stats()["steps"] == len(inputs) - skipped
    # The good steps follow fp32 training: fp16 keeps 11 significant bits.
    assert max(relative_errors(ours, theirs)) <= 1e-2, (ours, theirs)
    assert ours[-1] < 0.8 * ours[0]
