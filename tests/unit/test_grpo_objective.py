"""GRPO's objective (runtime/flows/grpo.py) against a hand-computed reference on a fixed batch: the clipped
ratio loss with old log-probabilities that differ from the current ones (so both clips happen), the k3 KL
to a reference, the on-policy case (no old log-probabilities: ratio 1, gradient = the policy gradient) and
the metrics. The reference is written out here, token by token, in plain Python."""

from __future__ import annotations

import math
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from megalaunch.runtime.flows.grpo import GRPOFlow  # noqa: E402

NAN = float("nan")
# two completions of 6 label positions; the mask marks the answer tokens
MASK = [[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1]]
LOGP = [[-1.0, -2.0, -0.5, -1.2, -0.3, -4.0], [-0.7, -0.9, -2.5, -0.1, -1.1, -0.6]]
OLD = [[NAN, NAN, -0.9, -1.2, -0.1, NAN], [NAN, -1.5, -1.0, -0.2, NAN, -0.55]]  # ratios e^.4, 1, e^-.2 / ...
ADV = [1.5, -0.8]
REWARD = [1.0, 0.0]
REF = [[-1.1, -2.0, -0.6, -1.0, -0.5, -4.0], [-0.5, -1.0, -2.0, -0.3, -1.0, -0.9]]


class FakeModel:
    """Returns the per-token loss -logp for the batch, from a leaf tensor whose gradient the test reads."""

    def __init__(self) -> None:
        self.logp = torch.tensor(LOGP, requires_grad=True)

    def __call__(self, tokens: Any, position_ids: Any, attention_mask: Any, labels: Any) -> Any:
        return -self.logp


def _batch(old: list[list[float]], with_ref: bool = False) -> dict[str, Any]:
    batch = {"tokens": torch.zeros(2, 6, dtype=torch.long), "labels": torch.zeros(2, 6, dtype=torch.long),
             "position_ids": torch.arange(6).repeat(2, 1), "loss_mask": torch.tensor(MASK, dtype=torch.float32),
             "old_logprobs": torch.tensor(old), "advantages": torch.tensor(ADV)[:, None].repeat(1, 6),
             "rewards": torch.tensor(REWARD)[:, None].repeat(1, 6)}
    if with_ref:
        batch["ref_logprobs"] = torch.tensor(REF)
    return batch


def _reference(old: list[list[float]], eps_low: float, eps_high: float, kl: float) -> tuple[float, list, int, int]:
    """Summed loss, d loss / d logp per token, clipped tokens, tokens: the formula written out."""
    total, grads, clipped, tokens = 0.0, [[0.0] * 6 for _ in range(2)], 0, 0
    for i in range(2):
        a = ADV[i]
        for t in range(6):
            if not MASK[i][t]:
                continue
            tokens += 1
            lp = LOGP[i][t]
            o = lp if math.isnan(old[i][t]) else old[i][t]
            r = math.exp(lp - o)
            rc = min(max(r, 1 - eps_low), 1 + eps_high)
            unclipped, clip_term = r * a, rc * a
            total += -min(unclipped, clip_term)
            # the unclipped term is taken (ties included) -> d/dlp = -a*r (on-policy: r = 1, o is detached)
            g = -a * r if unclipped <= clip_term else 0.0
            clipped += unclipped > clip_term
            if kl:
                d = REF[i][t] - lp
                total += kl * (math.exp(d) - d - 1)
                g += kl * (-math.exp(d) + 1)
            grads[i][t] = g
    return total, grads, clipped, tokens


@pytest.mark.parametrize(("eps_low", "eps_high", "kl"), [(0.2, 0.2, 0.0), (0.1, 0.28, 0.0), (0.2, 0.3, 0.05)])
def test_clipped_objective_equals_the_hand_computed_one(eps_low: float, eps_high: float, kl: float) -> None:
    flow = GRPOFlow()
    flow.config = {"clip_eps": eps_low, "clip_eps_high": eps_high, "kl_coeff": kl}
    model = FakeModel()
    out = flow.loss(model, _batch(OLD, with_ref=kl > 0))
    total, grads, clipped, tokens = _reference(OLD, eps_low, eps_high, kl)
    assert clipped >= 2  # the batch exercises the clip on both sides
    assert float(out.count) == tokens == 8
    assert float(out.loss.detach()) == pytest.approx(total, rel=1e-5, abs=1e-6)  # float32 against float64
    out.loss.backward()
    assert _close(model.logp.grad, grads)
    s, n = out.metrics["clip fraction"]
    assert (float(s), float(n)) == (clipped, tokens)
    s, n = out.metrics["reward"]
    assert float(s) / float(n) == pytest.approx(sum(REWARD) / 2)
    s, n = out.metrics["advantage"]
    assert float(s) / float(n) == pytest.approx(sum(ADV) / 2)
    assert ("kl" in out.metrics) == (kl > 0)


def _close(got: Any, want: list[list[float]]) -> bool:
    return all(abs(g - w) < 1e-5 for gr, wr in zip(got.tolist(), want, strict=True) for g, w in zip(gr, wr, strict=True))


def test_without_old_logprobs_the_ratio_is_one_and_the_gradient_the_policy_gradient() -> None:
    flow = GRPOFlow()
    flow.config = {"clip_eps": 0.2, "clip_eps_high": None, "kl_coeff": 0.0}
    model = FakeModel()
    out = flow.loss(model, _batch([[NAN] * 6, [NAN] * 6]))
    s, n = out.metrics["ratio"]
    assert float(s) / float(n) == pytest.approx(1.0)
    assert float(out.metrics["clip fraction"][0]) == 0
    assert float(out.loss.detach()) == pytest.approx(-(1.5 * 3 - 0.8 * 5))  # -sum over tokens of A
    out.loss.backward()
    want = [[-ADV[i] * MASK[i][t] for t in range(6)] for i in range(2)]  # d(-A logp)/d logp on answer tokens
    assert _close(model.logp.grad, want)
