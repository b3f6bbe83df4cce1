"""Edge cases of the KD losses and the cross entropy: k = vocabulary, masked vocabularies, -100 targets."""
import torch
import torch.nn.functional as F

from models import losses


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
