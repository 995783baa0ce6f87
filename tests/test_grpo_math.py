"""The maths of grpo.py against values computed by hand: the group advantages and every --loss-type."""

import math

import pytest
import torch

import grpo

# Two responses (rows) of up to three tokens; the second token of row 0 is padding, which must count for nothing
# even with absurd log-probabilities there. Per-token log-ratios to the proximal policy, by hand:
#   row 0: 0.3 (ratio 1.3499: above 1 + 0.2), masked;  row 1: 0.0, -0.5 (ratio 0.6065: below 1 - 0.2), 0.1.
OLD = torch.tensor([[-1.0, -5.0, -2.0], [-0.5, -1.0, -2.0]])
NEW = torch.tensor([[-0.7, 5.0, -2.0], [-0.5, -1.5, -1.9]])
REF = torch.tensor([[-0.9, 0.0, -2.0], [-0.6, -1.2, -2.0]])
MASK = torch.tensor([[True, False, True], [True, True, True]])
ADVANTAGES = torch.tensor([1.0, -2.0])
R = {(0, 0): math.exp(0.3), (0, 2): 1.0, (1, 0): 1.0, (1, 1): math.exp(-0.5), (1, 2): math.exp(0.1)}  # ratios
TOKENS = [(0, 0), (0, 2), (1, 0), (1, 1), (1, 2)]  # the response tokens


def loss_of(loss_type, new=NEW, cliprange_low=0.2, cliprange_high=0.2, beta=0.0, mean_tokens=5.0):
    return grpo.grpo_policy_loss(new, OLD, REF, ADVANTAGES, MASK, loss_type, cliprange_low, cliprange_high, beta,
                                 response_length=4, mean_tokens=mean_tokens)


def clipped_surrogate(i, j, ratio, low=0.2, high=0.2):
    a = ADVANTAGES[i].item()
    return -min(a * ratio, a * min(max(ratio, 1 - low), 1 + high))


def test_group_advantages_normalise_by_the_group_and_flag_groups_of_equal_scores():
    # k = 2 responses to 2 prompts, stored sample-major: [s0p0, s0p1, s1p0, s1p1]. Prompt 0 scored 1 and 3 (mean 2,
    # sample std sqrt(2)); prompt 1 scored 5 and 5: std 0, advantages 0, not a division by zero.
    advantages, equal = grpo.group_advantages(torch.tensor([1.0, 5.0, 3.0, 5.0]), 2)
    expected = 1 / (math.sqrt(2) + 1e-4)
    assert advantages.tolist() == pytest.approx([-expected, 0.0, expected, 0.0], abs=1e-6)
    assert equal.tolist() == [False, True, False, True]
    # Dr. GRPO: the mean is subtracted, nothing divided.
    assert grpo.group_advantages(torch.tensor([1.0, 5.0, 3.0, 5.0]), 2, scale=False)[0].tolist() == [-1, 0, 1, 0]
    # k = 3, one prompt scored 0, 1, 5: mean 2, sample std sqrt((4 + 1 + 9) / 2) = sqrt(7).
    advantages, equal = grpo.group_advantages(torch.tensor([0.0, 1.0, 5.0]), 3)
    assert advantages.tolist() == pytest.approx([x / (math.sqrt(7) + 1e-4) for x in (-2, -1, 3)], abs=1e-6)
    assert not equal.any()


def test_grpo_clips_at_both_bounds_and_averages_each_response_then_the_responses():
    loss, log_ratio, ratio, clipped = loss_of("grpo")
    # Row 0 (advantage 1): token 0's ratio 1.35 is clipped to 1.2, token 2's is 1. Row 1 (advantage -2): token 1's
    # ratio 0.61 is clipped to 0.8 (the pessimistic side for a negative advantage), the others are not.
    row0 = (-1.2 - 1.0) / 2
    row1 = (2.0 + 2 * 0.8 + 2 * math.exp(0.1)) / 3
    assert loss.item() == pytest.approx((row0 + row1) / 2, abs=1e-6)
    assert [clipped[t].item() for t in TOKENS] == [True, False, False, True, False]
    assert not clipped[0, 1] and log_ratio[0, 1] == 0  # padding
    assert [ratio[t].item() for t in TOKENS] == pytest.approx([R[t] for t in TOKENS], abs=1e-6)
    # A clipped token passes no gradient; the others pass -A * ratio / (tokens of its row * rows).
    new = NEW.clone().requires_grad_(True)
    loss_of("grpo", new=new)[0].backward()
    expected = torch.tensor([[0.0, 0.0, -1 / 4], [2 / 6, 0.0, 2 * math.exp(0.1) / 6]])
    assert torch.allclose(new.grad, expected, atol=1e-6)


def test_dr_grpo_sums_tokens_over_a_constant():
    loss = loss_of("dr_grpo")[0]
    total = sum(clipped_surrogate(*t, R[t]) for t in TOKENS)
    assert loss.item() == pytest.approx(total / (2 * 4), abs=1e-6)  # 2 responses x --response-length 4


def test_dapo_clips_higher_and_averages_over_the_mini_batch_tokens():
    loss, _, _, clipped = loss_of("dapo", cliprange_high=0.4, mean_tokens=8.0)
    # With 1 + 0.4 above row 0's ratio 1.35, that token is no longer clipped; the lower bound is unchanged.
    total = sum(clipped_surrogate(*t, R[t], high=0.4) for t in TOKENS)
    assert loss.item() == pytest.approx(total / 8.0, abs=1e-6)  # 8: the mini-batch's tokens per micro-batch
    assert [clipped[t].item() for t in TOKENS] == [False, False, False, True, False]


def test_gspo_takes_one_ratio_per_response_the_geometric_mean_of_its_tokens():
    loss, _, ratio, clipped = loss_of("gspo", cliprange_low=0.05, cliprange_high=0.05)
    row_ratios = [math.exp(0.3 / 2), math.exp((0.0 - 0.5 + 0.1) / 3)]  # 1.162 and 0.875
    assert ratio[0, 0].item() == pytest.approx(row_ratios[0]) and ratio[1, 2].item() == pytest.approx(row_ratios[1])
    # Row 0: clipped to 1.05 (advantage 1); row 1: clipped to 0.95 (advantage -2): -min(-1.75, -1.9) = 1.9.
    assert loss.item() == pytest.approx((-1.05 + 1.9) / 2, abs=1e-6)
    assert clipped[MASK].all()
    # Inside the range, the gradient of a response's loss reaches each of its tokens as the mean's 1/length.
    new = NEW.clone().requires_grad_(True)
    grpo.grpo_policy_loss(new, OLD, REF, ADVANTAGES, MASK, "gspo", 0.5, 0.5, 0.0, 4, 5.0)[0].backward()
    assert new.grad[0, 0].item() == pytest.approx(-row_ratios[0] / 2 / 2, abs=1e-6)  # / 2 tokens / 2 rows
    assert new.grad[1, 1].item() == pytest.approx(2 * row_ratios[1] / 3 / 2, abs=1e-6)
    assert new.grad[0, 1] == 0


def test_cispo_weights_every_token_by_its_clipped_ratio_without_its_gradient():
    loss, _, _, clipped = loss_of("cispo", cliprange_high=0.2, mean_tokens=5.0)
    weight = {t: min(R[t], 1.2) for t in TOKENS}  # row 0 token 0: 1.35 -> 1.2
    total = sum(-weight[t] * ADVANTAGES[t[0]].item() * NEW[t].item() for t in TOKENS)
    assert loss.item() == pytest.approx(total / 5.0, abs=1e-6)
    assert [clipped[t].item() for t in TOKENS] == [True, False, False, False, False]  # only the upper bound
    # The weight is a constant: d loss / d log pi = -weight * A / tokens, also for the clipped token (which PPO's
    # clip would silence) and for row 1's token 1, below 1 - 0.2 (CISPO has no lower bound).
    new = NEW.clone().requires_grad_(True)
    loss_of("cispo", new=new)[0].backward()
    for t in TOKENS:
        assert new.grad[t].item() == pytest.approx(-weight[t] * ADVANTAGES[t[0]].item() / 5.0, abs=1e-6)
    assert new.grad[0, 1] == 0


def test_the_kl_to_the_reference_is_the_k3_estimate_per_token_weighted_by_beta():
    without, with_kl = loss_of("grpo")[0], loss_of("grpo", beta=0.1)[0]
    k3 = {t: math.exp(REF[t] - NEW[t]) - (REF[t] - NEW[t]).item() - 1 for t in TOKENS}
    # grpo's aggregation: the mean over each row's tokens, then over rows.
    kl_term = ((k3[0, 0] + k3[0, 2]) / 2 + (k3[1, 0] + k3[1, 1] + k3[1, 2]) / 3) / 2
    assert (with_kl - without).item() == pytest.approx(0.1 * kl_term, abs=1e-6)
    assert all(v >= 0 for v in k3.values())


def test_a_group_of_equal_scores_adds_nothing_but_a_kl_term():
    advantages, equal = grpo.group_advantages(torch.tensor([2.0, 2.0, 2.0]), 3)
    assert equal.all() and not advantages.any()
    new = torch.tensor([[-1.0, -2.0], [-0.5, -0.7], [-3.0, -0.1]]).requires_grad_(True)
    old = new.detach() - 0.3
    for loss_type in grpo.LOSS_TYPES:
        loss = grpo.grpo_policy_loss(new, old, old, advantages, torch.ones(3, 2, dtype=torch.bool), loss_type,
                                     0.2, 0.2, 0.0, 2, 6.0)[0]
        assert loss.item() == 0.0, loss_type


@pytest.mark.parametrize("loss_type", grpo.LOSS_TYPES)
def test_every_loss_type_equals_trls_grpo_trainer(loss_type):
    """The same loss computed by TRL 1.16's GRPOTrainer._compute_loss on the same log-probabilities (its `self` a stub
    holding the settings it reads). TRL's names: GSPO is loss_type "grpo" with importance_sampling_level "sequence";
    CISPO's cap is its epsilon_high (our 1 + --cliprange-high); DAPO's and CISPO's token count is num_items_in_batch."""
    import collections
    import types

    from trl.trainer.grpo_trainer import GRPOTrainer

    torch.manual_seed(0)
    batch, length, low, high, beta, mean_tokens = 6, 5, 0.2, 0.28, 0.04, 17.0
    mask = torch.rand(batch, length) > 0.25
    mask[:, 0] = True
    old, ref = -torch.rand(batch, length) * 3, -torch.rand(batch, length) * 3
    new = old + torch.randn(batch, length) * 0.3  # ratios from about 0.4 to 2.5: both bounds clip
    advantages = torch.randn(batch)
    ours = grpo.grpo_policy_loss(new.masked_fill(~mask, 0.0), old.masked_fill(~mask, 0.0),
                                 ref.masked_fill(~mask, 0.0), advantages, mask, loss_type, low, high, beta,
                                 response_length=length, mean_tokens=mean_tokens)[0]

    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *args, **kwargs: (new, torch.zeros_like(new), None),
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None, use_vllm=False,
        importance_sampling_level="sequence" if loss_type == "gspo" else "token",
        loss_type="grpo" if loss_type == "gspo" else loss_type, beta=beta, epsilon_low=low,
        epsilon_high=1 + high if loss_type == "cispo" else high, max_completion_length=length,
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        model=types.SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, reduce=lambda x, reduction: x),
        _entropy_bonus_enabled=False, _metrics=collections.defaultdict(lambda: collections.defaultdict(list)))
    inputs = {"prompt_ids": torch.zeros(batch, 1, dtype=torch.long), "prompt_mask": torch.ones(batch, 1),
              "completion_ids": torch.zeros(batch, length, dtype=torch.long), "completion_mask": mask.float(),
              "advantages": advantages, "old_per_token_logps": old, "ref_per_token_logps": ref,
              "num_items_in_batch": torch.tensor(mean_tokens)}
    trls = GRPOTrainer._compute_loss(stub, None, inputs)
    assert ours.item() == pytest.approx(trls.item(), rel=1e-5, abs=1e-7)
