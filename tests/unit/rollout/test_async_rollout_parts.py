"""The asynchronous rollout's pure parts (no vLLM needed): the off-policy loss and the
replica's update gate."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from podium.errors import DeadlineExceededError, FailedPreconditionError, InvalidArgumentError
from podium.rollout.recipes.asyncgrpo import off_policy_loss
from podium.rollout.server import UpdateGate

WAIT_S = 30


def _grad(behaviour_shift: float, is_cap: float = 2.0) -> tuple[torch.Tensor, dict]:
    logp = torch.full((1, 3), -1.0, requires_grad=True)
    behaviour = logp.detach() - behaviour_shift  # shift > 0: the sampler found these tokens less likely
    loss, metrics = off_policy_loss(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 3), is_cap=is_cap)
    loss.backward()
    return logp.grad, metrics


def test_on_policy_samples_get_the_plain_policy_gradient():
    grad, metrics = _grad(0.0)
    # -adv * d logp / mean over 3 tokens, importance weight 1, nothing clipped.
    assert torch.allclose(grad, torch.full((1, 3), -1 / 3))
    assert metrics["is_weight"] == pytest.approx(1.0) and metrics["clipfrac"] == 0.0
    assert metrics["behaviour_gap"] == pytest.approx(0.0)


def test_stale_samples_are_reweighted_and_the_weight_is_truncated():
    grad, metrics = _grad(0.5)  # pi_prox / pi_behaviour = e^0.5 ~ 1.65, under the cap
    assert torch.allclose(grad, torch.full((1, 3), -torch.e ** 0.5 / 3))
    assert metrics["is_capped"] == 0.0 and metrics["behaviour_gap"] == pytest.approx(0.5)
    grad, metrics = _grad(3.0, is_cap=2.0)  # e^3 ~ 20 is cut to 2
    assert torch.allclose(grad, torch.full((1, 3), -2.0 / 3))
    assert metrics["is_capped"] == 1.0 and metrics["is_weight"] == pytest.approx(2.0)
    grad, _ = _grad(-0.5)  # the sampler liked them more: weight e^-0.5, not truncated below
    assert torch.allclose(grad, torch.full((1, 3), -torch.e ** -0.5 / 3))


def test_masked_tokens_do_not_count_and_bad_settings_are_refused():
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, _ = off_policy_loss(logp, logp.detach(), torch.tensor([2.0]), torch.tensor([[1, 0]]))
    loss.backward()
    assert logp.grad.tolist() == [[-2.0, 0.0]]
    with pytest.raises(InvalidArgumentError, match="is_cap"):
        off_policy_loss(logp, logp.detach(), torch.tensor([1.0]), torch.ones(1, 2), is_cap=0.5)


def test_the_gate_holds_requests_during_an_update_and_drains_admitted_ones():
    gate = UpdateGate()
    version, started = gate.admit(time.monotonic() + WAIT_S, lambda: "ran")
    assert (version, started, gate.active) == (0, "ran", 1)
    assert gate.close() == 1  # how many were running when it closed
    with pytest.raises(FailedPreconditionError, match="already"):
        gate.close()
    # Admitted before the close: drain waits for it, and names how many are left at its deadline.
    with pytest.raises(DeadlineExceededError, match="1 requests still running"):
        gate.drain(0.05)
    admitted: list = []
    waiter = threading.Thread(target=lambda: admitted.append(gate.admit(time.monotonic() + WAIT_S, lambda: "late")))
    waiter.start()
    gate.done()
    gate.drain(WAIT_S)
    assert gate.active == 0
    assert admitted == []  # still held: the gate is closed
    gate.open(version=4)
    waiter.join(WAIT_S)
    assert admitted == [(4, "late")]
    # A request that cannot get in before its deadline says why.
    gate.close()
    with pytest.raises(DeadlineExceededError, match="weight update"):
        gate.admit(0.0, lambda: None)


def test_a_retired_gate_fails_waiting_and_later_requests():
    from podium.errors import AbortedError

    gate = UpdateGate()
    gate.close()
    failed: list = []

    def wait() -> None:
        try:
            gate.admit(time.monotonic() + WAIT_S, lambda: "ran")
        except AbortedError as exc:
            failed.append(str(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    gate.retire("missed version 3")
    waiter.join(WAIT_S)
    assert failed == ["the replica no longer serves: missed version 3"]
    with pytest.raises(AbortedError, match="missed version 3"):
        gate.admit(time.monotonic() + WAIT_S, lambda: "ran")
    assert gate.active == 0
