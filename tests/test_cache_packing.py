"""The compact teacher cache (``recipes.distill.packing``) and what a cache loses (``models.losses.cache_kl``),
against hand formulas in float64."""
import math

import numpy as np
import pytest
import torch

from purestep.models import losses
from purestep.recipes.distill import packing


@pytest.mark.parametrize("bits", [1, 3, 7, 8, 13, 16, 17])
def test_bit_packing_round_trips_and_takes_the_stated_bytes(bits):
    rng = np.random.default_rng(bits)
    values = rng.integers(0, 2 ** bits, size=(3, 5, 11))
    packed = packing.pack_bits(values, bits)
    assert packed.dtype == np.uint8 and packed.shape == (3, 5, packing.packed_width(11, bits))
    assert np.array_equal(packing.unpack_bits(packed, bits, 11), values)


def test_id_bits_hold_the_largest_id():
    assert [packing.id_bits(v) for v in (2, 65, 256, 257, 49152, 65536, 128256)] == [1, 7, 8, 9, 16, 16, 17]


def test_quantized_log_probs_are_within_half_a_step_and_sum_to_one_with_the_missing_mass():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 300, generator=g) * 3
    ids, logprobs, missing = losses.teacher_topk(logits, 16, temperature=1.0)
    for bits in (4, 8, 12):
        codes, scale = packing.quantize(logprobs, bits)
        assert codes.min() == 0 and codes.max() == 2 ** bits - 1 and scale.dtype == torch.float16
        back, back_missing = packing.dequantize(codes, scale)
        step = scale[..., 0].float()[..., None]
        # below the top-1, each log-prob is within half a step (plus float16's rounding of the step)
        error = ((back - back[..., :1]) - (logprobs - logprobs[..., :1])).abs()
        assert (error <= step * (0.5 + 1e-3 * 2 ** bits)).all(), bits
        assert torch.allclose(back.exp().sum(-1) + back_missing, torch.ones(4, 6), atol=1e-6)
        assert torch.allclose(back_missing, missing, rtol=2e-3, atol=1e-6)


def hand_kl(logits: torch.Tensor, ids: torch.Tensor, logprobs: torch.Tensor, missing: torch.Tensor) -> tuple:
    """One position in float64: KL(p || p_hat) with p_hat spelled out over the whole vocabulary (the missing mass
    spread evenly), and the KL over the k + 1 outcomes (the k ids and the rest); both generalized (plus
    sum(p_hat) - 1)."""
    p = torch.softmax(logits.double(), -1)
    rest = logits.numel() - ids.numel()
    p_hat = torch.full_like(p, float(missing) / rest if rest else 0.0)
    p_hat[ids] = logprobs.double().exp()
    whole = float((p * (p.log() - p_hat.log())).sum())
    m = 1 - float(p[ids].sum())
    outcomes = float((p[ids] * (p[ids].log() - logprobs.double())).sum()) + (m * math.log(m / float(missing))
                                                                             if rest else 0.0)
    excess = float(p_hat.sum()) - 1                    # rounded values need not sum to one: the generalized KL
    return whole + excess, outcomes + excess


def test_cache_kl_equals_the_hand_formulas_and_is_zero_for_an_exact_full_cache():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(5, 12, generator=g) * 2
    log_p = torch.log_softmax(logits, -1)
    ids, logprobs, missing = losses.teacher_topk(logits, 4)
    codes, scale = packing.quantize(logprobs, 4)
    stores = {"plain": (logprobs.half().float(), missing), "packed": packing.dequantize(codes, scale)}
    found = {}
    for name, (stored, stored_missing) in stores.items():
        rounding, truncation = found[name] = losses.cache_kl(log_p, ids, stored, stored_missing)
        for i in range(5):
            whole, outcomes = hand_kl(logits[i], ids[i], stored[i], stored_missing[i])
            assert rounding[i].item() == pytest.approx(outcomes, abs=1e-6)
            assert (rounding[i] + truncation[i]).item() == pytest.approx(whole, abs=1e-6)
    assert torch.equal(found["plain"][1], found["packed"][1])            # the same ids: the same truncation
    assert (found["packed"][0] > found["plain"][0]).all()                 # 4-bit codes round more than float16
    exact = losses.cache_kl(log_p, ids, logprobs, missing)[0]
    assert exact.abs().max() < 1e-6
    ids, logprobs, missing = losses.teacher_topk(logits, 12)
    assert all(part.abs().max() < 1e-6 for part in losses.cache_kl(log_p, ids, logprobs, missing))
