"""Distillation's loss (runtime/flows/distill_loss.py) against a reference written out here, row by row, in plain
torch: the teacher's top-k plus a rest bucket, forward and reverse KL at a temperature (times T^2), mixed with
the hard-label loss, summed over the answer tokens; its gradient too."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")

from megalaunch.runtime.flows.distill_loss import distill_loss, distill_terms  # noqa: E402


def _batch(seed: int = 0, rows: int = 7, vocab: int = 11, k: int = 3):
    g = torch.Generator().manual_seed(seed)
    student = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    teacher = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * 2
    teacher_logp = torch.log_softmax(teacher, dim=-1)
    values, ids = torch.topk(teacher_logp, k, dim=-1)
    labels = torch.randint(0, vocab, (rows,), generator=g)
    mask = torch.tensor([0, 1, 1, 0, 1, 1, 1][:rows], dtype=torch.float32)
    return student, ids, values.float(), labels, mask


def _reference(student, ids, teacher_logp, labels, mask, *, t: float, direction: str, w: float):
    """The objective written out: buckets = the k ids + the rest; the teacher's masses tempered as p ** (1/T)
    and normalised over the k + 1 buckets; the student's from its full softmax at T."""
    total = torch.zeros((), dtype=torch.float64)
    for r in range(student.shape[0]):
        if mask[r] == 0:
            continue
        p_student = torch.softmax(student[r] / t, dim=-1)
        s_k = p_student[ids[r]]
        s = torch.cat([s_k, (1 - s_k.sum()).reshape(1)])
        t_k = teacher_logp[r].double().exp()
        q = torch.cat([t_k, (1 - t_k.sum()).clamp(min=1e-30).reshape(1)]) ** (1.0 / t)
        q = q / q.sum()
        kl = (q * (q.log() - s.log())).sum() if direction == "forward" else (s * (s.log() - q.log())).sum()
        ce = -torch.log_softmax(student[r], dim=-1)[labels[r]]
        total = total + (1 - w) * t * t * kl + w * ce
    return total


@pytest.mark.parametrize("direction", ["forward", "reverse"])
@pytest.mark.parametrize(("t", "w"), [(1.0, 0.0), (2.0, 0.0), (0.7, 0.3), (1.0, 1.0)])
def test_loss_and_gradient_equal_the_written_out_objective(direction: str, t: float, w: float) -> None:
    student, ids, teacher_logp, labels, mask = _batch()
    mine = student.clone().float().requires_grad_(True)
    terms = distill_terms(mine, ids, teacher_logp, labels, temperature=t, direction=direction)
    loss, count, metrics = distill_loss(terms, mask, temperature=t, hard_label_weight=w)
    ref_in = student.clone().requires_grad_(True)
    ref = _reference(ref_in, ids, teacher_logp, labels, mask, t=t, direction=direction, w=w)
    assert count.item() == 5
    assert math.isclose(loss.item(), ref.item(), rel_tol=1e-5, abs_tol=1e-6), (loss.item(), ref.item())
    loss.backward()
    ref.backward()
    assert torch.allclose(mine.grad.double(), ref_in.grad, rtol=1e-4, atol=1e-6)
    ce = sum(-torch.log_softmax(student[r], -1)[labels[r]].item() for r in range(7) if mask[r])
    assert math.isclose(metrics["hard-label ce"][0].item(), ce, rel_tol=1e-5)


def test_a_full_top_k_is_the_whole_kl_and_agreement_counts_top_ones() -> None:
    """k = the vocabulary (the rest is empty): the KL is the full-distribution KL; top-1 agreement counts
    rows where the student's most likely token is the teacher's."""
    student, _, _, labels, mask = _batch(rows=7, vocab=6, k=6)
    teacher = torch.randn(7, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    teacher[0] = student[0]  # the same distribution: KL 0, agreement
    teacher[2] = student[2] + 0.1
    lt = torch.log_softmax(teacher, -1)
    values, ids = torch.topk(lt, 6, dim=-1)
    terms = distill_terms(student.float(), ids, values.float(), labels)
    full = (lt.exp() * (lt - torch.log_softmax(student, -1))).sum(-1)
    assert torch.allclose(terms.kl.double(), full, atol=2e-5)
    assert abs(terms.kl[0].item()) < 1e-5
    agree = (student.argmax(-1) == teacher.argmax(-1)).float()
    assert torch.equal(terms.agree, agree.float())
    _, _, metrics = distill_loss(terms, mask)
    assert metrics["top-1 agreement"][0].item() == (agree * mask).sum().item()


def test_padding_rows_of_zeros_give_no_nan() -> None:
    """Rows past a document (ids 0, log-probs 0, mask 0) must not reach the loss or its gradient."""
    student, ids, lt, labels, mask = _batch()
    ids[0], lt[0] = 0, 0.0
    x = student.float().requires_grad_(True)
    loss, _, _ = distill_loss(distill_terms(x, ids, lt, labels, temperature=2.0, direction="reverse"), mask,
                              temperature=2.0, hard_label_weight=0.5)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(x.grad).all() and x.grad[0].abs().sum() == 0
