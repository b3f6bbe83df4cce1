"""GKD's generalized Jensen-Shannon divergence (Agarwal et al. 2024; TRL's ``GKDTrainer.generalized_jsd_loss``):
``kl=jsd`` with ``beta`` against a float64 hand formula, its ends equal to the forward and reverse KL, masked
positions and vocabularies, the top-k cache's k + 1 outcomes, and the caches that cannot give it refused (exit 2).
``kl=jsd beta=0.5 on_policy=0.5`` compiled, in one process and on 2 ranks, is tests/test_default_paths.py's."""
import math

import pytest
import torch

from purestep.models import losses
from purestep.recipes import main


def hand_jsd(teacher, student, beta, T=1.0, mask=None):
    """beta * KL(p||m) + (1 - beta) * KL(q||m), m = beta * p + (1 - beta) * q, in float64 (the paper's eq. 1 with
    TRL's mixture), summed over the vocabulary and averaged over the kept positions."""
    p, q = torch.softmax(teacher.double() / T, -1), torch.softmax(student.double() / T, -1)
    m = beta * p + (1 - beta) * q
    per = beta * (p * (p / m).log()).sum(-1) + (1 - beta) * (q * (q / m).log()).sum(-1)
    return per.mean() if mask is None else per[mask].mean()


def hand_kl(p_logits, q_logits, T=1.0):
    p, q = torch.softmax(p_logits.double() / T, -1), torch.softmax(q_logits.double() / T, -1)
    return (p * (p.log() - q.log())).sum(-1).mean()


def _logits(*shape, seed, scale=2.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("T", [1.0, 2.5])
@pytest.mark.parametrize("beta", [0.1, 0.5, 0.9])
def test_jsd_equals_the_float64_formula(beta, T):
    s, t = _logits(3, 5, 40, seed=1), _logits(3, 5, 40, seed=2)
    got = losses.kd_loss(s, t, temperature=T, direction="jsd", beta=beta)
    assert abs(got.double().item() - hand_jsd(t, s, beta, T).item()) < 1e-6


def test_the_mixture_weights_the_teacher_by_beta():
    """TRL's convention: m = beta * teacher + (1 - beta) * student (the other, m = beta * student + ..., is
    JSD at 1 - beta): beta 0.1 is near the forward KL's end, far from the value at 0.9."""
    s, t = _logits(4, 50, seed=12, scale=3.0), _logits(4, 50, seed=13, scale=3.0)
    got = losses.kd_loss(s, t, direction="jsd", beta=0.1).item()
    assert abs(got - hand_jsd(t, s, 0.1).item()) < 1e-6 and abs(got - hand_jsd(t, s, 0.9).item()) > 1e-2


def test_jsd_ends_are_the_forward_and_reverse_kl():
    s, t = _logits(2, 6, 30, seed=3), _logits(2, 6, 30, seed=4)
    for T in (1.0, 2.0):
        fkl, rkl = (losses.kd_loss(s, t, temperature=T, direction=d) for d in ("forward", "reverse"))
        assert torch.equal(losses.kd_loss(s, t, temperature=T, direction="jsd", beta=0.0), fkl)
        assert torch.equal(losses.kd_loss(s, t, temperature=T, direction="jsd", beta=1.0), rkl)
        assert abs(fkl.double().item() - hand_kl(t, s, T).item()) < 1e-6
        assert abs(rkl.double().item() - hand_kl(s, t, T).item()) < 1e-6
    # inside (0, 1) it is neither: at beta = 0.5 the symmetric JSD, at most log 2 and below both KLs
    mid = losses.kd_loss(s, t, direction="jsd", beta=0.5)
    assert 0 < mid.item() < math.log(2) and mid < losses.kd_loss(s, t) and mid < losses.kd_loss(s, t, direction="reverse")
    with pytest.raises(ValueError, match="beta"):
        losses.kd_loss(s, t, direction="jsd", beta=1.5)


def test_masked_positions_are_ignored_and_gradients_finite():
    """Positions whose target is negative hold inf / NaN logits: the value is the formula over the others, the
    gradient finite and zero there; Hinton's blend multiplies the JSD by T^2 as for the KLs."""
    s, t = _logits(2, 5, 16, seed=5), _logits(2, 5, 16, seed=6)
    y = torch.randint(0, 16, (2, 5), generator=torch.Generator().manual_seed(7))
    y[0, 1], y[1, 3] = -100, -1
    s[0, 1, 2], t[1, 3, 0] = float("inf"), float("nan")
    keep = y >= 0
    for beta in (0.0, 0.3, 1.0):
        student = s.clone().requires_grad_(True)
        loss, aux = losses.distill_objective(student, y, t, alpha=0.7, temperature=2.0, direction="jsd", beta=beta)
        if beta == 0.0:
            want = hand_kl(t[keep], s[keep], 2.0)
        elif beta == 1.0:
            want = hand_kl(s[keep], t[keep], 2.0)
        else:
            want = hand_jsd(t[keep], s[keep], beta, 2.0)
        assert abs(aux["kl"].double().item() - want.item()) < 1e-6
        ce = torch.nn.functional.cross_entropy(s[keep], y[keep])
        assert abs(loss.item() - (0.7 * 4.0 * aux["kl"].item() + 0.3 * ce.item())) < 1e-5
        loss.backward()
        assert torch.isfinite(student.grad).all() and (student.grad[0, 1] == 0).all() and (student.grad[1, 3] == 0).all()
        assert student.grad.abs().sum() > 0


def test_masked_vocabulary_and_learnable_temperature_keep_gradients_finite():
    """Ids both models mask (-inf logits) are outcomes neither puts mass on: the JSD over the rest, finite gradients
    into the logits and into a learnable temperature."""
    s, t = _logits(3, 4, 24, seed=8), _logits(3, 4, 24, seed=9)
    s[..., 18:], t[..., 18:] = float("-inf"), float("-inf")
    t[..., 15:18] = float("-inf")                          # and some only the teacher masks
    student, theta = s.clone().requires_grad_(True), torch.tensor(0.3, requires_grad=True)
    temperature = losses.learnable_temperature(theta, torch.tensor(5), t_min=1.0, t_max=3.0)
    got = losses.kd_loss(student, t, temperature=temperature, direction="jsd", beta=0.4)
    T = temperature.item()
    p = torch.softmax(t[..., :18].double() / T, -1)
    q = torch.softmax(s[..., :18].double() / T, -1)
    m = 0.4 * p + 0.6 * q
    want = (0.4 * torch.where(p > 0, p * (p / m).log(), 0).sum(-1) + 0.6 * (q * (q / m).log()).sum(-1)).mean()
    assert abs(got.double().item() - want.item()) < 1e-6
    got.backward()
    assert torch.isfinite(student.grad).all() and torch.isfinite(theta.grad) and theta.grad != 0


def test_topk_cache_jsd_over_the_k_ids_and_the_other_bucket():
    s, t = _logits(2, 4, 20, seed=10), _logits(2, 4, 20, seed=11)
    # k = V: no bucket, the full JSD
    ids, logprobs, missing = losses.teacher_topk(t, 20, temperature=1.5)
    full = losses.kd_loss(s, t, temperature=1.5, direction="jsd", beta=0.3)
    cached = losses.topk_kd_loss(s, ids, logprobs, missing, 1.5, direction="jsd", beta=0.3)
    assert abs(cached.item() - full.item()) < 1e-6
    # k < V: the JSD over k + 1 outcomes (the k ids, everything else), by hand in float64
    ids, logprobs, missing = losses.teacher_topk(t, 5)
    p = torch.softmax(t.double(), -1)
    q = torch.softmax(s.double(), -1)
    p_k, q_k = p.gather(-1, ids), q.gather(-1, ids)
    p5 = torch.cat([p_k, 1 - p_k.sum(-1, keepdim=True)], -1)
    q5 = torch.cat([q_k, 1 - q_k.sum(-1, keepdim=True)], -1)
    m = 0.6 * p5 + 0.4 * q5
    want = (0.6 * (p5 * (p5 / m).log()).sum(-1) + 0.4 * (q5 * (q5 / m).log()).sum(-1)).mean()
    student = s.clone().requires_grad_(True)
    got = losses.topk_kd_loss(student, ids, logprobs, missing, direction="jsd", beta=0.6)
    assert abs(got.double().item() - want.item()) < 1e-6
    got.backward()
    assert torch.isfinite(student.grad).all()
    # beta = 0 is the cache's forward KL
    assert abs(losses.topk_kd_loss(s, ids, logprobs, missing, direction="jsd", beta=0.0).item()
               - losses.topk_kd_loss(s, ids, logprobs, missing).item()) < 1e-7


# ------------------------------------------------------------------------------------------- the recipe

TINY = ["block_size=16", "batch_size=4", "sample_tokens=0", "save_every=0", "eval_batches=1", "eval_every=0",
        "warmup_steps=1", "log_every=1", "model.d_model=16", "model.n_layers=1", "model.n_heads=2"]


def test_caches_that_cannot_give_the_jsd_are_refused(tiny_teacher, token_cache, tmp_path, capsys):
    """A sampled cache holds counts, not probabilities: kl=jsd is refused naming kl= and the cache (exit 2); a top-k
    cache gives it short of beta = 1 (its reverse KL is infinite where the missing mass rounded to 0)."""
    teacher, data = tiny_teacher
    work = tmp_path
    common = [f"teacher={teacher}", f"data={data}", "steps=2"]
    for mode in ("sample", "topk"):
        assert main(["recipe=distill_cache", *common, "block_size=16", "batch_size=4", f"out={work / mode}",
                     f"mode={mode}", "k=4", "samples=4"]) == 0
    capsys.readouterr()
    run = ["recipe=distill", *common, *TINY, "compile=false"]
    assert main([*run, f"cache={work / 'sample'}", "kl=jsd", f"out={work / 'a'}"]) == 2
    err = capsys.readouterr().err
    assert "kl=jsd beta=0.5" in err and f"cache={work / 'sample'}" in err
    assert main([*run, f"cache={work / 'topk'}", "kl=jsd", "beta=1", f"out={work / 'b'}"]) == 2
    assert "kl=jsd beta=1" in capsys.readouterr().err
    # on-policy rows need the teacher on the student's own tokens, which no cache holds
    assert main([*run, f"cache={work / 'topk'}", "on_policy=0.5", f"out={work / 'd'}"]) == 2
    assert "on_policy=0.5 with cache=" in capsys.readouterr().err
    assert main([*run, f"cache={work / 'topk'}", "kl=jsd", "beta=0.7", f"out={work / 'c'}"]) == 0
    assert not any((work / name).exists() for name in "abd")
