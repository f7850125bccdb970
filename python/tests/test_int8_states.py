"""optimizer.states int8: the moments of tensors of at least 4096 elements in whole blocks of 256 kept as torchao's
AdamW8bit keeps them (8-bit codes, an fp32 scale a block), the others' in fp32, on every tier; 20 steps give
torchao's codes, scales and weights (test_state_formats.py: checkpoints, and what `strata checkpoint inspect`
says of them)."""

import functools

import numpy as np
import pytest
import torch

import strata
from models import GPT, batches, strata_losses, three_tiers, torch_losses

STEPS = 20
BLOCK = 256
HYPER = {"lr": 1e-2, "weight_decay": 0.01}
# Embeddings and projections of 4096 to 16384 elements (8-bit states) beside biases, norms and a position table
# under 4096 (fp32 states).
SmallGPT = functools.partial(GPT, vocab=64, hidden=64, layers=2, heads=2, seq=16)


def pair(seed=0):
    torch.manual_seed(seed)
    model = SmallGPT()
    reference = SmallGPT()
    reference.load_state_dict(model.state_dict())
    return model, reference


def tiers(tmp_path, **extra):
    """three_tiers' config for SmallGPT's 105k parameters (410KiB a kind): chunks of 16Ki elements, the device
    holds under two thirds of the parameters, the host some of every kind, NVMe the rest."""
    config = {"device": {"backend": "emulated", "budget": 256 * 1024}, "host": {"budget": 768 * 1024},
              "chunk": {"size_elems": 16384}, "optimizer": HYPER}
    return three_tiers(tmp_path, **{**config, **extra})


def int8_states(tmp_path, **extra):
    return tiers(tmp_path, optimizer={**HYPER, "states": "int8"}, **extra)


@pytest.fixture
def torchao_eager(monkeypatch):
    """torchao's AdamW8bit with strata's code maps (torchao's are the same within 2 ulps: test_state_codec.py), its
    step run eagerly (torchao compiles it; inductor's code rounds with the vector width it was built for)."""
    pytest.importorskip("torchao")
    from torchao.optim import AdamW8bit, subclass_8bit
    from strata import _strata
    for signed, name in ((True, "get_qmap_signed"), (False, "get_qmap_unsigned")):
        monkeypatch.setattr(subclass_8bit, name, lambda signed=signed: tuple(_strata.state_code_map(signed)))
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    return AdamW8bit


def registered(model):
    """The model's parameters by the engine's tensor id (registration order: named_parameters')."""
    return list(model.named_parameters())


def moment_blocks(engine, model):
    """Each tensor's 8-bit moments as the engine holds them: {(name, kind): (codes, scales)}."""
    params = registered(model)
    out = {}
    for c in engine.engine.chunks():
        if c["kind"] not in ("exp_avg", "exp_avg_sq") or c["dtype"] != "int8":
            continue
        data = np.frombuffer(engine.engine.read_chunk(c["id"]), dtype=np.uint8)
        for tensor, offset in zip(c["tensors"], c["tensor_offsets"]):
            name, p = params[tensor]
            numel = p.numel()
            blocks = data[offset:offset + numel // BLOCK * (BLOCK + 4)].reshape(-1, BLOCK + 4)
            out[(name, c["kind"])] = (torch.from_numpy(blocks[:, :BLOCK].copy()).reshape(-1),
                                               torch.from_numpy(blocks[:, BLOCK:].copy().view(np.float32)).reshape(-1))
    return out


def ulps(a, b):
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


class Part(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(n) * 0.02)

    def forward(self, x):
        return (self.w * x).sum()


class Linear(torch.nn.Module):
    """A loss linear in the weights: each step's gradients are its inputs whatever the weights, so that two
    optimizers are given the same gradients step after step. Tensors of 8-bit states (4096 to 16Ki elements)
    beside ones too small or not in whole blocks (fp32 states)."""

    SIZES = (16384, 4096, 300, 4097, 12288, 64)

    def __init__(self):
        super().__init__()
        self.parts = torch.nn.ModuleList(Part(n) for n in self.SIZES)

    def forward(self, inputs):
        return sum(part(x) for part, x in zip(self.parts, inputs))


def gradients(steps, seed=11):
    """Each step's inputs (the gradients): magnitudes from 1e-7 to 1 by block, as test_state_codec.py's."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        step = []
        for n in Linear.SIZES:
            blocks = (n + BLOCK - 1) // BLOCK
            magnitudes = torch.logspace(-7, 0, blocks).repeat_interleave(BLOCK)[:n]
            step.append(torch.randn(n, generator=generator) * magnitudes)
        out.append(step)
    return out


def test_twenty_steps_of_int8_states_give_torchaos_codes_scales_and_weights(tmp_path, torchao_eager):
    torch.manual_seed(0)
    model = Linear()
    reference = Linear()
    reference.load_state_dict(model.state_dict())
    # Its 37k parameters: the host holds some of them, NVMe the rest.
    engine = strata.initialize(model, int8_states(tmp_path, host={"budget": 384 * 1024}))
    assert {c["home"] for c in engine.engine.chunks()} >= {"host", "nvme"}  # states streamed from NVMe too
    optimizer = torchao_eager(reference.parameters(), **HYPER)
    for inputs in gradients(STEPS):
        engine.backward(engine(inputs))
        engine.step()
        reference(inputs).backward()
        optimizer.step()
        optimizer.zero_grad()

    blocks = moment_blocks(engine, reference)
    named = dict(reference.named_parameters())
    quantized = {name for name, p in named.items() if p.numel() >= 4096 and p.numel() % BLOCK == 0}
    assert {name for name, _ in blocks} == quantized and len(quantized) == 3
    codes = one_off = scales_off = 0
    for (name, kind), (our_codes, our_scales) in blocks.items():
        state = optimizer.state[named[name]][kind]
        apart = (our_codes.long() - state.codes.reshape(-1).long()).abs()
        codes += our_codes.numel()
        one_off += (apart == 1).sum().item()
        assert apart.max().item() <= 1, (name, kind)
        scales_off = max(scales_off, ulps(our_scales, state.scale.reshape(-1)).max().item())
    # torchao's eager step rounds some fp32 arithmetic differently from the compiled one strata matches bit for
    # bit (test_state_codec.py): a scale may move an ulp or two, and a value on a code's edge the code with it.
    assert scales_off <= 2 and one_off <= codes // 10000, (one_off, codes)
    state = engine.state_dict()
    for name, value in named.items():
        relative = ((state[name] - value.detach()).norm() / value.detach().norm()).item()
        assert relative <= 1e-6, (name, relative)


def test_a_gpt_trained_with_int8_states_follows_torchaos(tmp_path, torchao_eager):
    """The same through a model whose gradients follow its weights: the first steps' losses are torchao's within
    its ulps apart (above; where torch's kernels run narrower than the CPU, as `scripts/test.sh` runs them with
    AVX2, torchao's eager step rounds differently again), and they grow no further than a thousandth in 20 steps."""
    model, reference = pair()
    engine = strata.initialize(model, int8_states(tmp_path))
    data = batches(STEPS)
    optimizer = torchao_eager(reference.parameters(), **HYPER)
    ours, theirs = strata_losses(engine, data), torch_losses(reference, data, optimizer=optimizer)
    apart = [abs(a - b) / abs(b) for a, b in zip(ours, theirs)]
    assert ours[0] == theirs[0] and max(apart[:4]) <= 1e-6 and ours[-1] < 0.8 * ours[0], (ours, theirs)
    assert max(apart) <= 1e-3, (ours, theirs)


def test_int8_moments_take_a_quarter_of_fp32_ones_bytes(tmp_path):
    def moments(config):
        model, reference = pair()
        engine = strata.initialize(model, config)
        chunks = [c for c in engine.engine.chunks() if c["kind"] in ("exp_avg", "exp_avg_sq")]
        return chunks, {t: p.numel() for t, (_, p) in enumerate(registered(reference))}

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    int8, numel = moments(int8_states(tmp_path / "a"))
    fp32, _ = moments(tiers(tmp_path / "b"))
    assert {c["dtype"] for c in int8} == {"int8", "fp32"}
    for c in int8:
        quantized = c["dtype"] == "int8"
        assert all((numel[t] >= 4096 and numel[t] % BLOCK == 0) == quantized for t in c["tensors"]), c
        if quantized:  # every tensor on a block: 260 bytes a block, nothing between them
            assert all(offset % (BLOCK + 4) == 0 for offset in c["tensor_offsets"])
            assert c["used_bytes"] == sum(numel[t] for t in c["tensors"]) // BLOCK * (BLOCK + 4)
    quantized_elems = sum(c["used_bytes"] // (BLOCK + 4) * BLOCK for c in int8 if c["dtype"] == "int8")
    fp32_elems = sum(c["used_bytes"] // 4 for c in fp32)
    assert quantized_elems >= 0.9 * fp32_elems
    assert sum(c["used_bytes"] for c in int8) <= 0.3 * sum(c["used_bytes"] for c in fp32)


def test_int8_states_train_in_bf16_precision(tmp_path):
    model, _ = pair()
    engine = strata.initialize(model, int8_states(tmp_path, precision="bf16"))
    losses = strata_losses(engine, batches(STEPS))
    assert losses[-1] < 0.8 * losses[0]


def test_int8_states_for_sgd_are_refused(tmp_path):
    model, _ = pair()
    with pytest.raises(ValueError, match=r"optimizer\.states: int8 is for adam and adamw"):
        strata.initialize(model, tiers(tmp_path, optimizer={"type": "sgd", "momentum": 0.9, "states": "int8"}))
