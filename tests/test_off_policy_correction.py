"""The off-policy correction of rloo_vllm.py, ppo_vllm.py and grpo_vllm.py against hand-computed values: truncated
importance weights, their effective sample size, the mismatch KL, and the weighted losses."""

import math

import pytest
import torch

import grpo
import grpo_vllm
import ppo
import ppo_vllm
import rloo
import rloo_vllm


@pytest.mark.parametrize("script", [rloo_vllm, ppo_vllm, grpo_vllm])
def test_truncated_importance_weights_by_hand(script):
    # Ratios pi_prox / pi_behaviour of 1, 3 and 1/2; the fourth entry is masked out (padding).
    proximal = torch.tensor([0.0, math.log(3), -math.log(2), 5.0])
    behaviour = torch.zeros(4)
    mask = torch.tensor([True, True, True, False])
    weights, stats = script.truncated_importance_weights(proximal, behaviour, mask, cap=2.0)
    assert weights[:3].tolist() == pytest.approx([1.0, 2.0, 0.5])  # 3 is truncated at the cap
    assert stats["async/is_ess"] == pytest.approx(3.5 ** 2 / (3 * (1 + 4 + 0.25)))  # 0.778
    assert stats["async/is_truncated"] == pytest.approx(1 / 3)
    # Off (cap 0): every weight is 1; the statistics describe the untruncated ratios.
    weights, stats = script.truncated_importance_weights(proximal, behaviour, mask, cap=0.0)
    assert weights.tolist() == [1.0] * 4
    assert stats["async/is_ess"] == pytest.approx(4.5 ** 2 / (3 * (1 + 9 + 0.25)))  # 0.659
    assert stats["async/is_truncated"] == 0.0
    # The weights are constants: no gradient reaches the learner's log-probabilities through them.
    proximal.requires_grad_(True)
    assert not script.truncated_importance_weights(proximal, behaviour, mask, cap=2.0)[0].requires_grad


@pytest.mark.parametrize("script", [rloo_vllm, ppo_vllm])
def test_mismatch_kl_by_hand(script):
    # log r = log 2 on one token, -log 2 on another, padding ignored: mean of r - 1 - log r.
    proximal = torch.tensor([[math.log(2), -math.log(2), 7.0]])
    behaviour = torch.zeros(1, 3)
    mask = torch.tensor([[True, True, False]])
    expected = ((2 - 1 - math.log(2)) + (0.5 - 1 + math.log(2))) / 2  # 0.0966
    assert script.mismatch_kl(proximal, behaviour, mask) == pytest.approx(expected)
    assert script.mismatch_kl(proximal, proximal, mask) == 0.0  # same policy, no mismatch


def test_rloo_loss_weights_each_response_by_hand():
    # Two responses of one token each; the learner's log-probabilities moved by log 1.1 and log 0.5 from the
    # proximal ones; advantages +1 and -1; clip range 0.2; importance weights 2 and 0.5.
    old = torch.zeros(2, 1)
    new = torch.tensor([[math.log(1.1)], [math.log(0.5)]])
    advantages = torch.tensor([1.0, -1.0])
    weights = torch.tensor([2.0, 0.5])
    loss, _, ratio, clipped = rloo_vllm.rloo_policy_loss(new, old, advantages, 0.2, weights)
    # Response 1: max(-1.1, -1.1) = -1.1 (inside the clip range). Response 2: max(0.5, 0.8) = 0.8 (clipped).
    assert loss.item() == pytest.approx((2.0 * -1.1 + 0.5 * 0.8) / 2)  # -0.9
    assert ratio.tolist() == pytest.approx([1.1, 0.5]) and clipped.tolist() == [False, True]


def test_ppo_loss_weights_each_token_by_hand():
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(1.1), math.log(1.5), 0.0]])
    advantages = torch.tensor([[1.0, 1.0, 9.0]])
    mask = torch.tensor([[True, True, False]])
    weights = torch.tensor([[0.5, 2.0, 1.0]])
    loss = ppo_vllm.ppo_policy_loss(new, old, advantages, mask, 0.2, weights)[0]
    # Token 1: max(-1.1, -1.1) = -1.1; token 2: max(-1.5, -1.2) = -1.2; token 3 is padding.
    assert loss.item() == pytest.approx((0.5 * -1.1 + 2.0 * -1.2) / 2)  # -1.475


def test_with_weights_of_one_the_losses_are_the_synchronous_scripts():
    torch.manual_seed(0)
    new, old, advantages = torch.randn(6, 5), torch.randn(6, 5), torch.randn(6)
    a = rloo.rloo_policy_loss(new, old, advantages, 0.2)
    b = rloo_vllm.rloo_policy_loss(new, old, advantages, 0.2, torch.ones(6))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    mask = torch.rand(6, 5) > 0.3
    a = ppo.ppo_policy_loss(new, old, advantages[:, None].expand(6, 5), mask, 0.2)
    b = ppo_vllm.ppo_policy_loss(new, old, advantages[:, None].expand(6, 5), mask, 0.2, torch.ones(6, 5))
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    ref = torch.randn(6, 5)
    for loss_type in grpo.LOSS_TYPES:
        a = grpo.grpo_policy_loss(new, old, ref, advantages, mask, loss_type, 0.2, 0.3, 0.1, 5, 4.0)
        b = grpo_vllm.grpo_policy_loss(new, old, ref, advantages, mask, loss_type, 0.2, 0.3, 0.1, 5, 4.0,
                                       torch.ones(6, 5))
        assert all(torch.equal(x, y) for x, y in zip(a, b)), loss_type


def test_grpo_loss_weights_each_token_but_not_its_kl_term_by_hand():
    old = torch.zeros(1, 3)
    new = torch.tensor([[math.log(1.1), math.log(1.5), 0.0]])
    ref = torch.tensor([[math.log(1.1), math.log(1.5) - 0.2, 0.0]])  # the KL term of token 2 only
    mask = torch.tensor([[True, True, False]])
    weights = torch.tensor([[0.5, 2.0, 1.0]])
    loss = grpo_vllm.grpo_policy_loss(new, old, ref, torch.tensor([1.0]), mask, "grpo", 0.2, 0.2, 0.1, 3, 2.0,
                                      weights)[0]
    # As PPO's: token 1 -1.1, token 2 -min(1.5, 1.2) = -1.2, weighted; plus 0.1 k3(-0.2), unweighted; token 3 is padding.
    k3 = math.exp(-0.2) + 0.2 - 1
    assert loss.item() == pytest.approx((0.5 * -1.1 + 2.0 * (-1.2) + 0.1 * k3) / 2)
