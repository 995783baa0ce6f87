"""The maths of rloo.py against values computed by hand."""

import math

import torch

import rloo

STOP, PAD = 0, 1


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
