"""engine.optimizer: param groups and torch.optim.lr_scheduler schedules, against torch.optim on all three tiers."""

import json
import warnings

import pytest
import torch

import strata
from models import batches, pair, relative_errors, three_tiers

STEPS = 20


def no_decay(name):
    return name.endswith("bias") or any(part.startswith("ln") for part in name.split(".")[:-1])


def split(model):
    """TinyGPT's parameters: weights (decay) and biases and LayerNorm weights (none)."""
    decay = [p for n, p in model.named_parameters() if not no_decay(n)]
    rest = [p for n, p in model.named_parameters() if no_decay(n)]
    assert decay and rest
    return decay, rest


def warmup_cosine(optimizer):
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=0.1, total_iters=5)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=STEPS - 5, eta_min=1e-4)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[5])


def train(step, call, optimizer, scheduler, data):
    losses, lrs = [], []
    for tokens in data:
        loss = call(tokens[:, :-1], tokens[:, 1:])
        step(loss)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        lrs.append([g["lr"] for g in optimizer.param_groups])
    return losses, lrs


def assert_same_parameters(engine, reference, rtol=1e-6, twin=None):
    """Every parameter within `rtol` of torch's, relative to its norm, or else no further from it than torch's
    fused AdamW ends (`twin`: the reference trained again with it), and a little more. strata's kernel rounds as
    torch.optim does (Note [torch.optim's arithmetic]), bit for bit as the fused kernel, but the sqrt of torch's
    default AdamW is a last bit off in some elements of a tensor of 1,000 or more, how many depending on the CPU's
    vector width, and Adam amplifies that where the second moment is small: here torch's default and fused AdamW
    end 7e-7 apart with AVX2 kernels and 1.9e-6 with AVX-512 ones."""
    state = engine.state_dict()
    params = dict(reference.named_parameters())
    assert set(params) <= set(state), set(params) - set(state)
    for name, value in params.items():
        value = value.detach()
        bound = rtol * value.norm()
        if twin is not None:
            bound = max(bound, 1.25 * (twin[name] - value).norm())
        assert (state[name] - value).norm() <= bound, (name, (state[name] - value).norm() / value.norm())


def fused_adamw(params, **kwargs):
    """torch.optim.AdamW(fused=True), whose bits strata's kernel gives; None where this torch fuses on CUDA only
    (before 2.4)."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except RuntimeError:
        return None


def assert_identical_parameters(engine, reference):
    state = engine.state_dict()
    for name, value in reference.named_parameters():
        assert torch.equal(state[name], value.detach()), name


GROUPS = ({"weight_decay": 0.01}, {"weight_decay": 0.0, "lr": 2e-2})


def test_two_groups_under_warmup_and_cosine_match_torch_adamw(tmp_path):
    model, reference = pair()
    decay, rest = split(model)
    engine = strata.initialize(model, three_tiers(tmp_path, optimizer={"lr": 1e-2}),
                               param_groups=[{"params": decay, **GROUPS[0]}, {"params": rest, **GROUPS[1]}])
    assert {c["home"] for c in engine.engine.chunks()} >= {"host", "nvme"}
    scheduler = warmup_cosine(engine.optimizer)
    data = batches(STEPS)
    ours, our_lrs = train(engine.backward, engine, engine.optimizer, scheduler, data)

    ref_decay, ref_rest = split(reference)
    adamw = torch.optim.AdamW([{"params": ref_decay, **GROUPS[0]}, {"params": ref_rest, **GROUPS[1]}], lr=1e-2)
    theirs, their_lrs = train(lambda loss: loss.backward(), reference, adamw, warmup_cosine(adamw), data)

    _, twin_model = pair()
    fused = fused_adamw([{"params": p, **g} for p, g in zip(split(twin_model), GROUPS)], lr=1e-2)
    if fused is not None:
        train(lambda loss: loss.backward(), twin_model, fused, warmup_cosine(fused), data)

    assert our_lrs == their_lrs and our_lrs[0] != our_lrs[-1]
    assert max(relative_errors(ours, theirs)) <= 1e-6, (ours, theirs)
    assert ours[-1] < ours[0]
    assert_same_parameters(engine, reference,
                           twin=None if fused is None else {n: p.detach() for n, p in twin_model.named_parameters()})
    assert engine.stats()["steps"] == STEPS


def test_adamw_is_torchs_fused_adamw_bit_for_bit(tmp_path):
    # torch's fused CPU kernel rounds every operation as torch.optim's formulas do, with a correctly rounded sqrt:
    # from the same gradients strata's kernel gives the same bits, step after step.
    model, reference = pair()
    ref_decay, ref_rest = split(reference)
    fused = fused_adamw([{"params": ref_decay, **GROUPS[0]}, {"params": ref_rest, **GROUPS[1]}], lr=1e-2)
    if fused is None:
        pytest.skip(f"torch {torch.__version__} fuses AdamW on CUDA only")
    decay, rest = split(model)
    engine = strata.initialize(model, three_tiers(tmp_path, optimizer={"lr": 1e-2}),
                               param_groups=[{"params": decay, **GROUPS[0]}, {"params": rest, **GROUPS[1]}])
    data = batches(STEPS)
    ours, _ = train(engine.backward, engine, engine.optimizer, warmup_cosine(engine.optimizer), data)
    theirs, _ = train(lambda loss: loss.backward(), reference, fused, warmup_cosine(fused), data)
    assert ours == theirs
    assert_identical_parameters(engine, reference)


def test_sgd_with_momentum_under_step_lr_matches_torch(tmp_path):
    model, reference = pair()
    config = three_tiers(tmp_path, optimizer={"type": "sgd", "lr": 5e-2, "momentum": 0.9, "weight_decay": 0.01})
    engine = strata.initialize(model, config, param_groups=[
        {"params": split(model)[0]}, {"params": split(model)[1], "momentum": 0.5, "weight_decay": 0.0}])
    step_lr = lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)  # noqa: E731
    data = batches(12)
    ours, _ = train(engine.backward, engine, engine.optimizer, step_lr(engine.optimizer), data)
    sgd = torch.optim.SGD([{"params": split(reference)[0]},
                           {"params": split(reference)[1], "momentum": 0.5, "weight_decay": 0.0}],
                          lr=5e-2, momentum=0.9, weight_decay=0.01)
    theirs, _ = train(lambda loss: loss.backward(), reference, sgd, step_lr(sgd), data)
    assert ours == theirs  # SGD takes no sqrt: torch's arithmetic, bit for bit
    assert_identical_parameters(engine, reference)


def test_engine_step_counts_as_the_optimizers_step_for_a_scheduler(tmp_path):
    # A scheduler warns when it steps before its optimizer has: engine.step() must count as engine.optimizer.step().
    model, _ = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    scheduler = warmup_cosine(engine.optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for tokens in batches(3):
            engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
            assert engine.step()
            scheduler.step()
    assert engine.stats()["steps"] == 3


def test_an_lr_set_by_hand_takes_effect_at_the_next_step(tmp_path):
    model, reference = pair()
    engine = strata.initialize(model, three_tiers(tmp_path))
    fused = fused_adamw(reference.parameters(), lr=1e-2, weight_decay=0.01)
    adamw = fused or torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    data = batches(4)
    for i, tokens in enumerate(data):
        for optimizer in (engine.optimizer, adamw):
            optimizer.param_groups[0]["lr"] = 1e-2 * (i + 1)
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
        engine.optimizer.step()
        reference(tokens[:, :-1], tokens[:, 1:]).backward()
        adamw.step()
        adamw.zero_grad()
    if fused:  # torch's fused kernel: the same bits
        assert_identical_parameters(engine, reference)
    else:  # torch before 2.4: its default AdamW's sqrt, amplified as the lr grows (1.06e-6 on torch 2.1.2)
        assert_same_parameters(engine, reference, rtol=2e-6)


def test_the_no_decay_rule_is_the_hugging_face_trainers(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    model = transformers.LlamaForCausalLM(config)
    trainer_args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), report_to=[])
    trainer = transformers.Trainer(model=model, args=trainer_args)
    decays = set(trainer.get_decay_parameter_names(model))
    names = {id(p): n for n, p in model.named_parameters()}
    engine = strata.initialize(model, three_tiers(tmp_path, optimizer={"no_decay": ["bias", "norm"]}))
    decay, rest = engine.optimizer.param_groups
    assert {names[id(p)] for p in decay["params"]} == {n for n in names.values() if n in decays}
    assert {names[id(p)] for p in rest["params"]} == {n for n in names.values() if n not in decays}
    assert any("norm" in names[id(p)] for p in rest["params"]) and any(
        "bias" in names[id(p)] for p in rest["params"])
    assert (decay["weight_decay"], rest["weight_decay"]) == (0.01, 0.0)


def test_no_chunk_mixes_groups(tmp_path):
    model, _ = pair()
    decay, rest = split(model)
    engine = strata.initialize(model, three_tiers(tmp_path, chunk={"size_elems": 8192}),
                               param_groups=[{"params": rest}, {"params": decay}])
    in_group = {engine._table.by_param[id(p)].tensor_id: 0 for p in rest}
    in_group.update({engine._table.by_param[id(p)].tensor_id: 1 for p in decay})
    chunks = engine.engine.chunks()
    assert {c["param_group"] for c in chunks if c["kind"] == "grad"} == {0, 1}
    for chunk in chunks:
        if chunk["kind"] != "param" or chunk["tensors"][0] in in_group:
            assert {in_group[t] for t in chunk["tensors"]} == {chunk["param_group"]}, chunk


def frozen_first(model):
    model.wte.weight.requires_grad_(False)
    return model


@pytest.mark.parametrize("groups, message", [
    (lambda m: [{"params": ["nonsense.weight"]}], r"names 'nonsense.weight', which is no parameter"),
    (lambda m: [{"params": [torch.nn.Parameter(torch.ones(2))]}], r"no parameter of the model"),
    (lambda m: [{"params": list(m.parameters())}, {"params": [next(m.parameters())]}],
     r"'wpe' is in param_groups\[0\] and param_groups\[1\]"),
    (lambda m: [{"params": list(m.parameters())[1:]}], r"trainable parameters in no param group: wpe"),
    (lambda m: [{"params": list(frozen_first(m).parameters())}], r"'wte.weight', which is frozen"),
    (lambda m: [], r"non-empty list of dicts"),
    (lambda m: [{"params": list(m.parameters()), "lr": -1.0}], r"param_groups\[0\].*lr -1 must be"),
    (lambda m: [{"params": list(m.parameters()), "betas": (0.9, 1.0)}], r"param_groups\[0\].*beta2 1 must be"),
])
def test_bad_groups_are_refused_at_initialize(tmp_path, groups, message):
    model, reference = pair()
    with pytest.raises(ValueError, match=message):
        strata.initialize(model, three_tiers(tmp_path), param_groups=groups(model))
    # Refused before strata took the model: its parameters are plain ones with their values, and it can be given
    # to strata again.
    for (name, mine), theirs in zip(model.named_parameters(), reference.parameters()):
        assert type(mine) is torch.nn.Parameter and torch.equal(mine, theirs), name
    (tmp_path / "again").mkdir()
    strata.initialize(model, three_tiers(tmp_path / "again"))


def test_bad_values_are_refused_at_the_step_naming_the_group_and_key(tmp_path):
    model, _ = pair()
    decay, rest = split(model)
    engine = strata.initialize(model, three_tiers(tmp_path), param_groups=[{"params": decay}, {"params": rest}])
    tokens = batches(1)[0]
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.optimizer.param_groups[1]["eps"] = -1e-8
    with pytest.raises(ValueError, match=r"param_groups\[1\]: .*optimizer param group 1: eps -1e-08 must be > 0"):
        engine.optimizer.step()
    engine.optimizer.param_groups[1]["lr"] = "fast"
    with pytest.raises(TypeError, match=r"param_groups\[1\]\['lr'\]: 'fast' must be a number"):
        engine.optimizer.step()
    engine.optimizer.param_groups[1].update(lr=1e-3, eps=1e-8)
    engine.optimizer.step()  # nothing was changed: the step goes on
    assert engine.stats()["steps"] == 1
    with pytest.raises(RuntimeError, match="fixed at strata.initialize"):
        engine.optimizer.add_param_group({"params": []})


def test_the_config_rule_and_groups_exclude_each_other_and_bad_rules_are_named(tmp_path):
    model, _ = pair()
    with pytest.raises(ValueError, match="give one of them"):
        strata.initialize(model, three_tiers(tmp_path, optimizer={"no_decay": ["bias"]}),
                          param_groups=[{"params": list(model.parameters())}])
    with pytest.raises(ValueError, match=r"optimizer.no_decay: 'biases' is not allowed: expected a list of bias, norm"):
        strata.initialize(model, three_tiers(tmp_path, optimizer={"no_decay": ["biases"]}))


def test_a_checkpoint_keeps_each_groups_values(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    model, other = pair()
    engine = strata.initialize(model, three_tiers(tmp_path / "a"),
                               param_groups=[{"params": split(model)[0], "lr": 3e-3},
                                             {"params": split(model)[1], "weight_decay": 0.0, "betas": (0.8, 0.99)}])
    tokens = batches(1)[0]
    engine.backward(engine(tokens[:, :-1], tokens[:, 1:]))
    engine.optimizer.step()
    engine.optimizer.param_groups[0]["lr"] = 7e-4  # set after the step: the next step's, and the one saved
    saved = engine.save_checkpoint(tmp_path / "ckpt")
    manifest = json.loads((tmp_path / "ckpt" / "step-00000001" / "manifest.json").read_text())
    assert [g["lr"] for g in manifest["optimizer"]["param_groups"]] == [7e-4, 1e-2]

    resumed = strata.initialize(other, three_tiers(tmp_path / "b"),
                                param_groups=[{"params": split(other)[0]}, {"params": split(other)[1]}])
    resumed.load_checkpoint(saved["path"])
    groups = resumed.optimizer.param_groups
    assert (groups[0]["lr"], groups[0]["weight_decay"], groups[1]["weight_decay"]) == (7e-4, 0.01, 0.0)
    assert tuple(groups[1]["betas"]) == (0.8, 0.99)

    # A manifest saved before param groups: every group at the config's values.
    del manifest["optimizer"]["param_groups"]
    (tmp_path / "ckpt" / "step-00000001" / "manifest.json").write_text(json.dumps(manifest))
    resumed.load_checkpoint(saved["path"])
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [1e-2, 1e-2]
    assert [g["weight_decay"] for g in resumed.optimizer.param_groups] == [0.01, 0.01]

    single = strata.initialize(pair()[0], three_tiers(tmp_path / "b"))
    with pytest.raises(ValueError, match="holds another model"):  # its tensors' groups differ
        single.load_checkpoint(saved["path"])
