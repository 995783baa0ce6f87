"""The maths of ppo.py against values computed by hand; padded positions must never count."""

import math
import os

import torch
from conftest import TINY
from transformers import AutoModelForSequenceClassification, AutoTokenizer

import data
import ppo


def test_token_rewards_are_the_kl_penalty_plus_the_score_at_the_last_real_token():
    scores = torch.tensor([2.0, -1.0])
    logprobs = torch.tensor([[-1.0, -2.0, -3.0], [-1.0, -9.0, -9.0]])
    ref_logprobs = torch.tensor([[-1.5, -2.0, -2.0], [-0.5, 0.0, 0.0]])
    padding = torch.tensor([[False, False, False], [False, True, True]])
    rewards = ppo.token_rewards(scores, logprobs, ref_logprobs, padding, kl_coef=0.1)
    # Row 0: log-ratios 0.5, 0, -1 -> -0.05, 0, 0.1, and the score 2 at the last token.
    # Row 1: one real token with log-ratio -0.5 -> 0.05 - 1; nothing after it.
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.0, 2.1], [-0.95, 0.0, 0.0]]))


def test_gae_by_hand_and_padding_ends_the_episode():
    rewards = torch.tensor([[1.0, 2.0, 3.0], [1.0, 5.0, 7.0]])
    values = torch.tensor([[0.5, 1.0, 1.5], [2.0, 9.0, 9.0]])  # row 1's last two are padding: ignored
    padding = torch.tensor([[False, False, False], [False, True, True]])
    advantages, returns = ppo.gae_advantages(rewards, values, padding, gamma=1.0, lam=0.5)
    # Row 0: deltas 1 + 1 - 0.5 = 1.5, 2 + 1.5 - 1 = 2.5, 3 - 1.5 = 1.5;
    #   A2 = 1.5, A1 = 2.5 + 0.5 * 1.5 = 3.25, A0 = 1.5 + 0.5 * 3.25 = 3.125.
    # Row 1: the episode ends at token 0: A0 = 1 - 2 = -1; padded positions get 0.
    assert torch.allclose(advantages, torch.tensor([[3.125, 3.25, 1.5], [-1.0, 0.0, 0.0]]))
    assert torch.allclose(returns, torch.tensor([[3.625, 4.25, 3.0], [1.0, 0.0, 0.0]]))  # advantages + values


def test_gae_with_lambda_1_gives_discounted_returns_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.3, -0.2, 0.7]])
    _, returns = ppo.gae_advantages(rewards, values, torch.zeros(1, 3, dtype=torch.bool), gamma=0.9, lam=1.0)
    assert torch.allclose(returns, torch.tensor([[1 + 0.9 * 2 + 0.81 * 3, 2 + 0.9 * 3, 3.0]]))


def test_whitening_uses_only_real_tokens():
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, -100.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    whitened = ppo.masked_whiten(values, mask)
    # Mean 2.5, unbiased variance of 1, 2, 3, 4 is 5/3.
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / math.sqrt(5 / 3)
    assert torch.allclose(whitened[mask], expected, atol=1e-6)


def test_clipped_policy_loss_per_token():
    advantages = torch.tensor([[1.0, -1.0, 50.0]])
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.5, -0.5, 3.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False]])  # the third position is padding
    loss, log_ratio, ratio, clipped = ppo.ppo_policy_loss(new, old, advantages, mask, cliprange=0.2)
    # Token 0: ratio e^0.5 > 1.2 with a positive advantage: clipped, -1.2.
    # Token 1: ratio e^-0.5 < 0.8 with a negative advantage: clipped, 0.8.
    assert math.isclose(loss.item(), (-1.2 + 0.8) / 2, rel_tol=1e-6)
    assert clipped[mask].tolist() == [True, True]
    loss.backward()
    assert new.grad.abs().max().item() == 0.0  # both real tokens clipped, the padded one does not count
    # Inside the clip range the gradient is -advantage * ratio / number of real tokens.
    new = torch.tensor([[0.1, -0.1, 3.0]], requires_grad=True)
    ppo.ppo_policy_loss(new, old, advantages, mask, cliprange=0.2)[0].backward()
    expected = [-math.exp(0.1) / 2, math.exp(-0.1) / 2, 0.0]
    assert torch.allclose(new.grad, torch.tensor([expected]))


def test_clipped_value_loss():
    old = torch.tensor([[1.0, 1.0, 9.0]])
    new = torch.tensor([[1.5, 0.9, 100.0]])
    returns = torch.tensor([[2.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    loss, clipped = ppo.ppo_value_loss(new, old, returns, mask, cliprange_value=0.2)
    # Token 0: the new value 1.5 is clipped to 1.2: max((1.5-2)^2, (1.2-2)^2) = 0.64.
    # Token 1: 0.9 is inside the range: 0.81. Half their mean.
    assert math.isclose(loss.item(), 0.5 * (0.64 + 0.81) / 2, rel_tol=1e-6)
    assert clipped[mask].tolist() == [True, False]


def test_explained_variance():
    returns = torch.tensor([[1.0, 2.0, 4.0], [3.0, 50.0, 50.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    assert math.isclose(ppo.explained_variance(returns, returns, mask).item(), 1.0)
    assert abs(ppo.explained_variance(torch.full_like(returns, 7.0), returns, mask).item()) < 1e-6
    assert ppo.explained_variance(-returns, returns, mask).item() < 0  # worse than a constant


def test_value_of_each_state_is_the_reward_model_score_of_the_prefix():
    """At the start the value model is the reward model: the value before response token j is the
    reward model's score of prompt + the first j response tokens, so positions line up."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "reward"))
    model = AutoModelForSequenceClassification.from_pretrained(os.path.join(TINY, "reward"), num_labels=1).eval()
    pad = tokenizer.pad_token_id
    prompts = [tokenizer.encode("SUBREDDIT: r/travel\nPOST: rain hotel\nTL;DR:"), tokenizer.encode("SUBREDDIT: r/tech\nTL;DR:")]
    response = tokenizer.encode(" train beach plane")
    queries = data.left_pad(prompts, pad, "cpu")
    context_length = queries.shape[1]
    query_responses = torch.cat([queries, torch.tensor([response, response[:1] + [pad, pad]])], 1)
    with torch.no_grad():
        values = ppo.value_forward(model, query_responses, pad, context_length)
        for j in range(len(response)):
            prefix_scores = ppo.reward_scores(model, query_responses[:, : context_length + j], pad)
            assert torch.allclose(values[0, j], prefix_scores[0], atol=1e-5)
            if j < 2:  # the second response has one real token: states before it and after it
                assert torch.allclose(values[1, j], prefix_scores[1], atol=1e-5)
    assert values[0].std() > 0.1  # the prefix scores differ, so the comparison means something
