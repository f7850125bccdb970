"""The 8-bit states' codec and update against torchao's 8-bit Adam: the same code maps to within 2 ulps,
and given the same maps the same codes and scales, and 20 steps of Adam and AdamW with the same codes."""

import pytest
import torch
from torchao.optim.quant_utils import create_dynamic_map, quantize_8bit_with_qmap, scale_tensor

from strata import _strata

BLOCK = 256


def quantized(values, signed):
    codes, scales = _strata.quantize_states(values.numpy(), signed)
    return (torch.frombuffer(bytearray(codes), dtype=torch.uint8),
            torch.frombuffer(bytearray(scales), dtype=torch.float32))


@pytest.mark.parametrize("signed", [True, False])
def test_the_code_maps_are_torchaos_within_two_ulps(signed):
    ours = torch.tensor(_strata.state_code_map(signed), dtype=torch.float32)
    theirs = torch.tensor(create_dynamic_map(signed), dtype=torch.float32)
    # torchao's comes from torch.linspace, whose last bits follow the vector width torch's kernels run at.
    ulps = (ours.view(torch.int32).long() - theirs.view(torch.int32).long()).abs()
    assert ulps.max().item() <= 2
    assert torch.equal(ours, ours.sort().values) and ours[-1].item() == 1.0


@pytest.mark.parametrize("signed", [True, False])
def test_codes_and_scales_are_torchaos_given_the_same_map(signed):
    generator = torch.Generator().manual_seed(5)
    blocks = 96
    # Blocks of magnitudes from 1e-9 to 10, a block of zeros, values exactly on the map and midway between two.
    values = torch.randn(blocks * BLOCK, generator=generator) * torch.logspace(-9, 1, blocks).repeat_interleave(BLOCK)
    if not signed:
        values = values.square()
    qmap = torch.tensor(_strata.state_code_map(signed), dtype=torch.float32)
    values[:BLOCK] = 0
    values[BLOCK:2 * BLOCK] = qmap[torch.arange(BLOCK)]
    values[2 * BLOCK:3 * BLOCK - 1] = (qmap[:-1] + qmap[1:]) / 2
    codes, scales = quantized(values, signed)
    scaled, their_scales = scale_tensor(values.clone(), BLOCK)
    assert torch.equal(scales, their_scales)
    assert torch.equal(codes, quantize_8bit_with_qmap(scaled, qmap))


def test_values_not_in_whole_blocks_are_refused_naming_the_block():
    with pytest.raises(ValueError, match="300 values; they must come in whole blocks of 256"):
        _strata.quantize_states(torch.zeros(300).numpy(), True)
    with pytest.raises(ValueError, match="float32"):
        _strata.quantize_states(torch.zeros(256, dtype=torch.float64).numpy(), True)


def run_both(adamw, steps, monkeypatch):
    """`steps` steps of torchao's 8-bit Adam(W), run eagerly, and of strata's scalar reference on the same
    weights and gradients (torchao given strata's code maps); yields each step's torchao state and strata's
    arrays. Eagerly: torchao compiles its step, and inductor's code rounds with the vector width it is built
    for (with torch's kernels forced narrower than the CPU's, as `scripts/test.sh --isa avx2` does, its
    compiled step was wrong outright here); the eager step is the same on every CPU."""
    import numpy as np
    from torchao.optim import Adam8bit, AdamW8bit, subclass_8bit
    for signed, name in ((True, "get_qmap_signed"), (False, "get_qmap_unsigned")):
        monkeypatch.setattr(subclass_8bit, name, lambda signed=signed: tuple(_strata.state_code_map(signed)))
    monkeypatch.setattr(torch, "compile", lambda function, **options: function)
    blocks = 64
    n = blocks * BLOCK
    generator = torch.Generator().manual_seed(11)
    start = torch.randn(n, generator=generator) * 0.02
    reference = torch.nn.Parameter(start.clone())
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    optimizer = (AdamW8bit if adamw else Adam8bit)([reference], **hyper)
    weights = start.clone().numpy()
    codes = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
    scales = [np.zeros(blocks, dtype=np.float32) for _ in range(2)]
    magnitudes = torch.logspace(-7, 0, blocks).repeat_interleave(BLOCK)  # gradients from 1e-7 to 1 by block
    for step in range(1, steps + 1):
        grad = torch.randn(n, generator=generator) * magnitudes
        reference.grad = grad.clone()
        optimizer.step()
        _strata.adam8bit_step(weights, grad.numpy(), codes, scales, step=step, adamw=adamw, **hyper)
        yield optimizer.state[reference], reference.detach(), torch.from_numpy(weights), codes, scales


def ulps(a, b):
    return (a.view(torch.int32).long() - b.view(torch.int32).long()).abs()


@pytest.mark.parametrize("adamw", [True, False])
def test_twenty_steps_of_8bit_adam_give_torchaos_codes(adamw, monkeypatch):
    """Every code torchao's; the scales (a block's largest moment) within 2 ulps and the weights within 1e-7
    relative: its eager step rounds some of the fp32 arithmetic differently (strata's matched its compiled
    step bit for bit on an AVX-512 machine)."""
    for state, theirs, ours, codes, scales in run_both(adamw, 20, monkeypatch):
        for k, name in enumerate(("exp_avg", "exp_avg_sq")):
            assert torch.equal(torch.from_numpy(codes[k]), state[name].codes.reshape(-1)), name
            assert ulps(torch.from_numpy(scales[k]), state[name].scale).max().item() <= 2, name
        assert ((ours - theirs).norm() / theirs.norm()).item() <= 1e-7


def test_the_8bit_step_refuses_arrays_of_the_wrong_size_or_kind():
    import numpy as np
    n = 2 * BLOCK
    weights, grads = np.zeros(n, dtype=np.float32), np.zeros(n, dtype=np.float32)
    codes = [np.zeros(n, dtype=np.uint8) for _ in range(2)]
    scales = [np.zeros(2, dtype=np.float32) for _ in range(2)]
    hyper = {"step": 1, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    with pytest.raises(ValueError, match="scales must be one contiguous dimension of float32 of 2 elements"):
        _strata.adam8bit_step(weights, grads, codes, [scales[0], np.zeros(3, dtype=np.float32)], **hyper)
    with pytest.raises(ValueError, match="codes must be one contiguous dimension of uint8"):
        _strata.adam8bit_step(weights, grads, [codes[0], codes[1].astype(np.int32)], scales, **hyper)
    with pytest.raises(ValueError, match="step 0"):
        _strata.adam8bit_step(weights, grads, codes, scales, **{**hyper, "step": 0})
    assert not weights.any() and not any(c.any() for c in codes)  # nothing written by a refused call
