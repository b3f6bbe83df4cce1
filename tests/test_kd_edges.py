"""Edge cases of the KD losses and the cross entropy: k = vocabulary, masked vocabularies, -100 targets."""
import math

import torch
import torch.nn.functional as F

from purestep.models import losses


def _logits(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def test_topk_with_k_equal_to_the_vocabulary_is_the_full_kl():
    student, teacher = _logits(3, 5, 50, seed=1), _logits(3, 5, 50, seed=2) * 3
    ids, logprobs, missing = losses.teacher_topk(teacher, k=50, temperature=2.0)   # real missing mass, not zeros
    full = losses.kd_loss(student, teacher, temperature=2.0)
    cached = losses.topk_kd_loss(student, ids, logprobs, missing, temperature=2.0)
    assert torch.allclose(cached, full, rtol=1e-5, atol=1e-6), (cached, full)


def test_masked_teacher_vocabulary_gives_the_kl_over_the_rest():
    student, teacher = _logits(4, 6, 32, seed=3), _logits(4, 6, 32, seed=4)
    masked = teacher.clone()
    masked[..., 20:] = float("-inf")                   # a teacher that may not emit the last 12 ids
    p = F.softmax(teacher[..., :20], -1)
    log_q = F.log_softmax(student, -1)[..., :20]
    expected = (p * (p.log() - log_q)).sum(-1).mean()  # the KL by hand: p is zero on the masked ids
    theta = torch.tensor(1.5, requires_grad=True)      # a learnable temperature needs finite gradients too
    got = losses.kd_loss(student, masked, temperature=theta / 1.5)
    assert torch.isfinite(got) and torch.allclose(got, expected, rtol=1e-5), (got, expected)
    got.backward()
    assert torch.isfinite(theta.grad)
    both = student.clone()
    both[..., 20:] = float("-inf")                     # masked on both sides: the reverse KL is finite too
    reverse = losses.kd_loss(both, masked, direction="reverse")
    log_p, q = F.log_softmax(teacher[..., :20], -1), F.softmax(student[..., :20], -1)
    assert torch.allclose(reverse, (q * (q.log() - log_p)).sum(-1).mean(), rtol=1e-5)


def test_hugging_face_ignore_index_is_ignored_everywhere():
    logits, targets = _logits(2, 7, 11, seed=5), torch.randint(0, 11, (2, 7), generator=torch.Generator().manual_seed(6))
    targets[0, :3] = -100
    targets[1, 5] = -1
    keep = targets >= 0
    expected = F.cross_entropy(logits[keep], targets[keep])
    assert losses.IGNORE_INDEX == -100
    assert torch.allclose(losses.cross_entropy(logits, targets), expected)
    loss, aux = losses.distill_objective(logits, targets, _logits(2, 7, 11, seed=7), alpha=0.0)
    assert torch.allclose(aux["ce"], expected) and torch.allclose(loss, expected)


# ---------------------------------------------------------------- masked positions holding inf / NaN (issue 31)

STUDENT = [[1.0, 2.0, 0.5, -1.0], [float("inf"), 0.0, 1.0, 2.0], [0.0, -0.5, 3.0, 1.0]]
TEACHER = [[2.0, 1.0, 0.0, 0.5], [float("nan"), 1.0, 0.0, 0.0], [1.0, 1.0, 2.0, -2.0]]
TARGETS = [2, -100, 3]            # the middle position is ignored; its logits hold inf (student) and NaN (teacher)


def _plain_log_softmax(z, t):
    top = max(v / t for v in z)
    lse = top + math.log(sum(math.exp(v / t - top) for v in z))
    return [v / t - lse for v in z]


def _plain_kl(log_p, log_q):
    return sum(math.exp(a) * (a - b) for a, b in zip(log_p, log_q))


def _kept(rows):
    return [r for r, y in zip(rows, TARGETS) if y >= 0]


def _plain(direction, t):
    """The KL averaged over the kept positions, by hand (Python floats, no torch)."""
    out = []
    for s, te in zip(_kept(STUDENT), _kept(TEACHER)):
        log_q, log_p = _plain_log_softmax(s, t), _plain_log_softmax(te, t)
        fkl, rkl = _plain_kl(log_p, log_q), _plain_kl(log_q, log_p)
        out.append({"forward": fkl, "reverse": rkl, "symmetric": 0.1 * fkl + 0.9 * rkl}[direction])
    return sum(out) / len(out)


def _plain_ce():
    return sum(-_plain_log_softmax(s, 1.0)[y] for s, y in zip(_kept(STUDENT), _kept(TARGETS))) / 2


def _masked_inputs():
    student = torch.tensor([STUDENT], requires_grad=True)
    return student, torch.tensor([TEACHER]), torch.tensor([TARGETS])


def test_inf_and_nan_at_ignored_positions_give_the_hand_value_and_finite_gradients():
    """A masked position is dropped by torch.where, whatever it holds: the KD terms, the CE and Hinton's blend equal
    the plain formula over the kept positions, and the gradients (student logits, a learnable temperature) are
    finite, zero at the ignored position. A product by the mask gave NaN (inf * 0)."""
    for direction in ("forward", "reverse", "symmetric"):
        student, teacher, y = _masked_inputs()
        theta = torch.tensor(0.0, requires_grad=True)          # T = 1 + sigmoid(0) = 1.5, a learnable temperature
        t = losses.learnable_temperature(theta, torch.tensor(10), t_min=1.0, t_max=2.0)
        kl = losses.kd_loss(student, teacher, temperature=t, direction=direction, mask=y >= 0)
        assert math.isclose(kl.item(), _plain(direction, 1.5), rel_tol=1e-5), (direction, kl.item())
        kl.backward()
        assert torch.isfinite(student.grad).all() and torch.isfinite(theta.grad) and theta.grad != 0
        assert (student.grad[0, 1] == 0).all()
    student, teacher, y = _masked_inputs()
    y[0, 1] = -1                                               # -1 marks a masked position too
    loss, aux = losses.distill_objective(student, y, teacher, alpha=0.5, temperature=2.0)
    hand = 0.5 * 4.0 * _plain("forward", 2.0) + 0.5 * _plain_ce()
    assert math.isclose(loss.item(), hand, rel_tol=1e-5) and math.isclose(aux["ce"].item(), _plain_ce(), rel_tol=1e-5)
    loss.backward()
    assert torch.isfinite(student.grad).all() and (student.grad[0, 1] == 0).all()


def test_cached_targets_with_nan_at_ignored_positions_give_the_hand_value():
    """Top-k (k = V: the exact KL) and sampled caches whose ignored position holds NaN log-probs, a NaN missing
    mass, out-of-range ids and NaN weights: the hand value over the kept positions, finite gradients."""
    student, teacher, y = _masked_inputs()
    ids, logprobs, missing = losses.teacher_topk(torch.nan_to_num(teacher), k=4)
    logprobs[0, 1], missing[0, 1], ids[0, 1] = float("nan"), float("nan"), 10 ** 9
    kl = losses.topk_kd_loss(student, ids, logprobs, missing, mask=y >= 0)
    assert math.isclose(kl.item(), _plain("forward", 1.0), rel_tol=1e-5), kl.item()
    kl.backward()
    assert torch.isfinite(student.grad).all() and (student.grad[0, 1] == 0).all()
    student, _, y = _masked_inputs()
    sample_ids = torch.tensor([[[2, 0], [10 ** 9, 1], [1, 3]]])
    weights = torch.tensor([[[0.75, 0.25], [float("nan"), float("inf")], [0.5, 0.5]]])
    got = losses.sampled_kd_loss(student, sample_ids, weights, mask=y >= 0)
    rows = [_plain_log_softmax(s, 1.0) for s in _kept(STUDENT)]
    hand = (-(0.75 * rows[0][2] + 0.25 * rows[0][0]) - (0.5 * rows[1][1] + 0.5 * rows[1][3])) / 2
    assert math.isclose(got.item(), hand, rel_tol=1e-5), (got.item(), hand)
    got.backward()
    assert torch.isfinite(student.grad).all() and (student.grad[0, 1] == 0).all()
