"""The maths of rloo.py against values computed by hand."""

import math

import torch

import rloo

STOP, PAD = 0, 1


def test_truncate_response_pads_after_the_first_stop_token_and_from_the_first_pad():
    responses = torch.tensor([
        [5, 3, STOP, 7, STOP],  # text after the stop token becomes padding; the stop token stays
        [5, 6, 7, 8, 9],  # no stop token: unchanged
        [STOP, 4, 4, 4, 4],  # an empty response
        [5, PAD, 6, 7, 8],  # a sampled pad token ends the response
    ])
    assert rloo.truncate_response(responses, STOP, PAD).tolist() == [
        [5, 3, STOP, PAD, PAD],
        [5, 6, 7, 8, 9],
        [STOP, PAD, PAD, PAD, PAD],
        [5, PAD, PAD, PAD, PAD],
    ]


def test_missing_eos_penalty_is_added_only_without_a_stop_token():
    responses = torch.tensor([[5, STOP, PAD], [5, 6, 7], [STOP, PAD, PAD]])
    scores = rloo.apply_missing_eos_penalty(torch.tensor([1.0, 2.0, -0.5]), responses, STOP, -1.0, "add")
    assert scores.tolist() == [1.0, 1.0, -0.5]


def test_logprobs_use_logits_divided_by_the_temperature():
    # Query of 2 tokens, response of 2 tokens, vocabulary of 3: positions 1 and 2 predict the response.
    logits = torch.zeros(1, 4, 3)
    logits[0, 1] = torch.tensor([2.0, 0.0, 0.0])
    logits[0, 2] = torch.tensor([0.0, 4.0, 2.0])
    logprobs = rloo.response_logprobs(logits, torch.tensor([[0, 2]]), context_length=2, temperature=2.0)
    # Scaled logits [1, 0, 0] and [0, 2, 1]: log p = x_i - log(sum exp x).
    expected = [1 - math.log(math.e + 2), 1 - math.log(1 + math.e ** 2 + math.e)]
    assert torch.allclose(logprobs, torch.tensor([expected]), atol=1e-6)


def test_leave_one_out_advantages():
    # k = 3 samples of 2 prompts, stored sample-major: [s0p0, s0p1, s1p0, s1p1, s2p0, s2p1].
    rewards = torch.tensor([1.0, 10.0, 2.0, 20.0, 6.0, 60.0])
    # Prompt 0: 1 - (2+6)/2 = -3, 2 - (1+6)/2 = -1.5, 6 - (1+2)/2 = 4.5; prompt 1 ten times that.
    assert rloo.rloo_advantages(rewards, 3).tolist() == [-3.0, -30.0, -1.5, -15.0, 4.5, 45.0]
    # With k = 2 the baseline is the other sample: advantages are +-half the difference.
    assert rloo.rloo_advantages(torch.tensor([1.0, 5.0, 3.0, 2.0]), 2).tolist() == [-2.0, 3.0, 2.0, -3.0]


def test_clipped_sequence_level_loss():
    advantages = torch.tensor([1.0, -1.0, 2.0])
    old = torch.zeros(3, 2)
    # Sequence log-ratios 0.5, -0.5 and 0.1 (split over two tokens).
    new = torch.tensor([[0.25, 0.25], [-0.5, 0.0], [0.05, 0.05]])
    loss, log_ratio, ratio, clipped = rloo.rloo_policy_loss(new, old, advantages, cliprange=0.2)
    # Sequence 0: ratio e^0.5 = 1.649 > 1.2 with a positive advantage: clipped, loss -1.2.
    # Sequence 1: ratio e^-0.5 = 0.607 < 0.8 with a negative advantage: clipped, loss 0.8.
    # Sequence 2: ratio e^0.1 inside the range: loss -2 e^0.1.
    assert torch.allclose(log_ratio, torch.tensor([0.5, -0.5, 0.1]))
    assert clipped.tolist() == [True, True, False]
    assert math.isclose(loss.item(), (-1.2 + 0.8 - 2 * math.exp(0.1)) / 3, rel_tol=1e-6)
    # Gradients flow only through the unclipped sequence.
    new.requires_grad_(True)
    rloo.rloo_policy_loss(new, old, advantages, 0.2)[0].backward()
    assert torch.allclose(new.grad, torch.tensor([[0.0, 0.0], [0.0, 0.0], [-2 * math.exp(0.1) / 3] * 2]))


def test_entropy_from_logits():
    assert math.isclose(rloo.entropy_from_logits(torch.zeros(5)).item(), math.log(5), rel_tol=1e-6)
    p = torch.tensor([0.25, 0.75])
    assert math.isclose(rloo.entropy_from_logits(p.log()).item(), -(p * p.log()).sum().item(), rel_tol=1e-6)


def test_masked_mean_ignores_padding():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert rloo.masked_mean(values, mask).item() == 2.0


def test_prompt_batches_cover_an_epoch_without_repeats_and_split_between_ranks():
    seen = []
    for update in range(3):  # 3 batches of 2 ranks x 2 prompts = 12 of 13 prompts
        shares = [rloo.prompt_batch(13, 2, update, seed=7, rank=r, world_size=2) for r in range(2)]
        assert all(len(s) == 2 for s in shares)
        seen += shares[0] + shares[1]
    assert len(set(seen)) == 12
    next_epoch = rloo.prompt_batch(13, 2, 3, seed=7, rank=0, world_size=2)
    assert next_epoch == rloo.prompt_batch(13, 2, 3, seed=7, rank=0, world_size=2)  # deterministic
    assert rloo.prompt_batch(13, 2, 0, seed=8, rank=0, world_size=2) != rloo.prompt_batch(13, 2, 0, 7, 0, 2)
