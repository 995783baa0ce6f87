"""The off-policy correction of rloo_vllm.py, ppo_vllm.py and grpo_vllm.py against hand-computed values: truncated
importance weights, their effective sample size, the mismatch KL, and the weighted losses."""

import math
import typing

import pytest
import torch

import grpo
import grpo_vllm
import ppo
import ppo_vllm
import rloo
import rloo_vllm

LOSS_TYPES = typing.get_args(grpo.Args.__dataclass_fields__["loss_type"].type)  # --loss-type's choices


@pytest.mark.parametrize("script", [rloo_vllm, ppo_vllm, grpo_vllm])
def test_token_weights_truncated_or_masked_by_hand(script):
    # Ratios pi_prox / pi_behaviour of 1, 3 and 1/2; the fourth entry is masked out (padding).
    proximal = torch.tensor([[0.0, math.log(3), -math.log(2), 5.0]])
    behaviour = torch.zeros(1, 4)
    mask = torch.tensor([[True, True, True, False]])
    weights, stats = script.importance_weights(proximal, behaviour, mask, 2.0, "token", "truncate")
    assert weights[0, :3].tolist() == pytest.approx([1.0, 2.0, 0.5])  # 3 is truncated at the cap
    assert stats["async/is_ess"] == pytest.approx(3.5 ** 2 / (3 * (1 + 4 + 0.25)))  # 0.778
    assert stats["async/is_mean"] == pytest.approx(3.5 / 3)
    assert stats["async/is_truncated"] == pytest.approx(1 / 3)
    weights, stats = script.importance_weights(proximal, behaviour, mask, 2.0, "token", "mask")
    assert weights[0, :3].tolist() == pytest.approx([1.0, 0.0, 0.5])  # 3 is above the cap: out of the loss
    assert stats["async/is_ess"] == pytest.approx(1.5 ** 2 / (3 * (1 + 0.25)))  # 0.6
    assert stats["async/is_mean"] == pytest.approx(0.5) and stats["async/is_truncated"] == pytest.approx(1 / 3)
    # Off (cap 0): every weight is 1; the statistics describe the untruncated ratios.
    weights, stats = script.importance_weights(proximal, behaviour, mask, 0.0, "token", "truncate")
    assert weights.tolist() == [[1.0] * 4]
    assert stats["async/is_ess"] == pytest.approx(4.5 ** 2 / (3 * (1 + 9 + 0.25)))  # 0.659
    assert stats["async/is_truncated"] == 0.0
    # The weights are constants: no gradient reaches the learner's log-probabilities through them.
    proximal.requires_grad_(True)
    assert not script.importance_weights(proximal, behaviour, mask, 2.0, "token", "truncate")[0].requires_grad


@pytest.mark.parametrize("script", [rloo_vllm, ppo_vllm, grpo_vllm])
def test_sequence_and_geometric_weights_by_hand(script):
    # Response 0: token ratios 3 and 1/2 (padding after); response 1: three tokens of ratio 2.
    proximal = torch.tensor([[math.log(3), -math.log(2), 9.0], [math.log(2)] * 3])
    behaviour = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, True, True]])
    weights, stats = script.importance_weights(proximal, behaviour, mask, 2.0, "sequence", "truncate")
    assert weights.tolist() == pytest.approx([1.5, 2.0])  # products 1.5 and 8, truncated at 2
    assert stats["async/is_truncated"] == 0.5 and stats["async/is_mean"] == pytest.approx(1.75)
    assert script.importance_weights(proximal, behaviour, mask, 2.0, "sequence", "mask")[0].tolist() == \
        pytest.approx([1.5, 0.0])
    weights, stats = script.importance_weights(proximal, behaviour, mask, 2.0, "geometric", "truncate")
    assert weights.tolist() == pytest.approx([math.sqrt(1.5), 2.0])  # (3 x 1/2)^(1/2) and (2^3)^(1/3)
    assert stats["async/is_truncated"] == 0.0


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_an_extreme_log_ratio_makes_no_nan(level):
    proximal = torch.tensor([[1000.0, -1000.0, 0.0], [0.0, 0.0, 0.0]])
    behaviour, mask = torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.bool)
    for cap, mode in [(2.0, "truncate"), (2.0, "mask"), (0.0, "truncate")]:
        weights, stats = rloo_vllm.importance_weights(proximal, behaviour, mask, cap, level, mode)
        assert torch.isfinite(weights).all() and all(math.isfinite(v) for v in stats.values()), (cap, mode, stats)
    assert math.isfinite(rloo_vllm.mismatch_kl(proximal, behaviour, mask))
    assert math.isfinite(rloo_vllm.proximal_mean(torch.tensor([1.0, 2.0]), proximal, behaviour, mask))


def test_sequence_weights_collapse_on_long_responses_at_bf16s_mismatch_and_geometric_ones_do_not():
    """Per-token log-ratios of bf16 vLLM against the learner as measured on SmolLM2 (a mismatch KL of about 3e-3 per
    token, docs/results.md): normal with variance 2 x 3e-3 and mean -3e-3 (E[r] = 1 under the behaviour policy).
    The product of a response's ratios spreads as its length grows: truncated at 2, its weights shrink the gradient
    (their mean) and its effective sample size. Their geometric mean stays near 1 at any length, as do token weights."""
    generator = torch.Generator().manual_seed(0)

    def stats(length, level):
        log_ratio = torch.randn(256, length, generator=generator) * math.sqrt(6e-3) - 3e-3
        mask = torch.ones(256, length, dtype=torch.bool)
        return rloo_vllm.importance_weights(log_ratio, torch.zeros(256, length), mask, 2.0, level, "truncate")[1]

    short, long, longer = stats(16, "sequence"), stats(1000, "sequence"), stats(4000, "sequence")
    assert short["async/is_ess"] > 0.85 and short["async/is_mean"] == pytest.approx(1, abs=0.05)  # 0.91, 1.01
    assert long["async/is_ess"] < 0.4 and long["async/is_mean"] < 0.4  # 0.25, 0.28
    assert longer["async/is_ess"] < 0.05 and longer["async/is_mean"] < 0.05  # 0.01, 0.01: the gradient is gone
    for level in ("geometric", "token"):
        cured = stats(4000, level)
        assert cured["async/is_ess"] > 0.99 and cured["async/is_mean"] == pytest.approx(1, abs=0.01), (level, cured)


def test_proximal_mean_reweights_the_behaviour_policys_samples_by_hand():
    # Two responses with KLs 1 and 3; the learner gives the second twice the behaviour policy's probability
    # (two tokens of ratio sqrt 2) and the first the same: weights 1 and 2, normalised 1/3 and 2/3.
    proximal = torch.tensor([[0.0, 0.0], [math.log(2) / 2] * 2])
    behaviour, mask = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    assert rloo_vllm.proximal_mean(torch.tensor([1.0, 3.0]), proximal, behaviour, mask) == pytest.approx(7 / 3)
    assert rloo_vllm.proximal_mean(torch.tensor([1.0, 3.0]), behaviour, behaviour, mask) == pytest.approx(2.0)


@pytest.mark.parametrize("script", [rloo_vllm, ppo_vllm, grpo_vllm])
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
    for loss_type in LOSS_TYPES:
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
