"""The 8-bit states' codec against torchao's (the reference for issue 36's int8 states): the same code
maps to within 2 ulps, and the same codes and scales given the same map."""

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
    with pytest.raises(ValueError, match="whole blocks of 256.*300 elements"):
        _strata.quantize_states(torch.zeros(300).numpy(), True)
    with pytest.raises(ValueError, match="float32"):
        _strata.quantize_states(torch.zeros(256, dtype=torch.float64).numpy(), True)
