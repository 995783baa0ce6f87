"""The maths of grpo.py against values computed by hand: the group advantages, every --loss-type, each loss type's
defaults, DAPO's overlong shaping, overlong filtering and dynamic sampling (in runs on the math task)."""

import math
import os

import pytest
import typing

import torch

import grpo
import grpo_vllm
from conftest import algorithm_metrics, assert_bad_input_result, read_metrics, run_dir_of, run_script

LOSS_TYPES = typing.get_args(grpo.Args.__dataclass_fields__["loss_type"].type)  # --loss-type's choices

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
    advantages = grpo.group_advantages(torch.tensor([1.0, 5.0, 3.0, 5.0]), 2)
    equal = grpo.groups_of_equal_rewards(torch.tensor([1.0, 5.0, 3.0, 5.0]), 2)
    expected = 1 / (math.sqrt(2) + 1e-4)
    assert advantages.tolist() == pytest.approx([-expected, 0.0, expected, 0.0], abs=1e-6)
    assert equal.tolist() == [False, True, False, True]
    # Dr. GRPO: the mean is subtracted, nothing divided.
    assert grpo.group_advantages(torch.tensor([1.0, 5.0, 3.0, 5.0]), 2, scale=False).tolist() == [-1, 0, 1, 0]
    # k = 3, one prompt scored 0, 1, 5: mean 2, sample std sqrt((4 + 1 + 9) / 2) = sqrt(7).
    advantages = grpo.group_advantages(torch.tensor([0.0, 1.0, 5.0]), 3)
    assert advantages.tolist() == pytest.approx([x / (math.sqrt(7) + 1e-4) for x in (-2, -1, 3)], abs=1e-6)
    assert not grpo.groups_of_equal_rewards(torch.tensor([0.0, 1.0, 5.0]), 3).any()


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
    advantages = grpo.group_advantages(torch.tensor([2.0, 2.0, 2.0]), 3)
    assert grpo.groups_of_equal_rewards(torch.tensor([2.0, 2.0, 2.0]), 3).all() and not advantages.any()
    new = torch.tensor([[-1.0, -2.0], [-0.5, -0.7], [-3.0, -0.1]]).requires_grad_(True)
    old = new.detach() - 0.3
    for loss_type in LOSS_TYPES:
        loss = grpo.grpo_policy_loss(new, old, old, advantages, torch.ones(3, 2, dtype=torch.bool), loss_type,
                                     0.2, 0.2, 0.0, 2, 6.0)[0]
        assert loss.item() == 0.0, loss_type


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
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


# What each loss type's paper ran: (beta, cliprange_low, cliprange_high, overlong_buffer, dynamic_sampling_rounds)
# with --response-length 16. Shao et al. 2024 (GRPO: beta 0.04, PPO's clip 0.2); Liu et al. 2025 (Dr. GRPO: no KL);
# Yu et al. 2025 (DAPO: no KL, clip 0.2 / 0.28, a buffer of 4096 of 20480 tokens, verl's recipe 10 generation
# batches); Zheng et al. 2025 (GSPO: no KL, 3e-4 / 4e-4); MiniMax 2025 with ScaleRL's cap of 5 (CISPO: no lower clip).
PAPERS = {"grpo": (0.04, 0.2, 0.2, 0, 0), "dr_grpo": (0.0, 0.2, 0.2, 0, 0), "dapo": (0.0, 0.2, 0.28, 3, 10),
          "gspo": (0.0, 3e-4, 4e-4, 0, 0), "cispo": (0.0, None, 4.0, 0, 0)}


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("module", [grpo, grpo_vllm], ids=["grpo.py", "grpo_vllm.py"])
def test_a_bare_loss_type_runs_its_papers_settings_and_a_value_passed_wins(module, loss_type):
    args = module.Args(loss_type=loss_type)
    module.validate(args)
    names = ("beta", "cliprange_low", "cliprange_high", "overlong_buffer", "dynamic_sampling_rounds")
    in_force = tuple(getattr(args, name, 0) for name in names)  # grpo_vllm.py has no dynamic sampling
    assert in_force == PAPERS[loss_type][:4] + ((PAPERS[loss_type][4],) if module is grpo else (0,))
    passed = module.Args(loss_type=loss_type, beta=0.5, cliprange_high=0.5, overlong_buffer=2,
                         **({} if loss_type == "cispo" else {"cliprange_low": 0.5}))
    module.validate(passed)
    assert (passed.beta, passed.cliprange_high, passed.overlong_buffer) == (0.5, 0.5, 2)
    assert passed.cliprange_low == (None if loss_type == "cispo" else 0.5)


def responses_of(lengths, response_length=10):
    """Responses of these lengths (the stop token, id 2, last; then padding, 0), or cut at response_length (None)."""
    responses = torch.full((len(lengths), response_length), 5)
    for row, length in enumerate(lengths):
        if length is not None:
            responses[row, length - 1] = 2
            responses[row, length:] = 0
    return responses


def test_overlong_shaping_falls_linearly_over_the_buffer_and_gives_a_cut_response_all_of_it():
    # --response-length 10, a buffer of 4: no penalty up to 6 tokens (the stop token counted), then a quarter of the
    # full penalty a token to all of it at 10; a response cut at 10 (no stop token) gets all of it (Eq. 13).
    responses = responses_of([3, 6, 7, 9, 10, None])
    penalty = grpo.overlong_penalty(responses, 2, 10, 4, 1.0)
    assert penalty.tolist() == [0.0, 0.0, -0.25, -0.75, -1.0, -1.0]
    assert grpo.overlong_penalty(responses, 2, 10, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.375, -0.5, -0.5]
    assert grpo.overlong_penalty(responses, 2, 10, 0, 1.0).tolist() == [0.0] * 6  # no buffer: no shaping
    assert torch.equal(grpo_vllm.overlong_penalty(responses, 2, 10, 4, 1.0), penalty)


@pytest.mark.parametrize("module", [grpo, grpo_vllm], ids=["grpo.py", "grpo_vllm.py"])
@pytest.mark.parametrize("missing_eos_penalty", [-1.0, 0.0])
def test_with_overlong_shaping_a_cut_response_loses_the_full_penalty_whatever_the_missing_eos_penalty(
        module, missing_eos_penalty):
    """Three responses, all correct (the rule's 1): one ends early, one in the soft zone (8 of 10 tokens, a buffer of
    4: half the way), one is cut at 10. Under the rule the full penalty is 0.5, half its 0/1 range as Eq. 13's 1 is of
    DAPO's +-1; with a reward model, 1. With --missing-eos-penalty -1 or 0 alike, the cut response scores below the
    one that stopped late (before, at 0, it scored above it). Without shaping, the missing-EOS penalty applies."""
    responses, rewards = responses_of([3, 8, None]), torch.ones(3)
    args = module.Args(overlong_buffer=4, response_length=10, missing_eos_penalty=missing_eos_penalty,
                       rule_reward="last_number")
    assert module.shaped_scores(args, rewards, responses, 2).tolist() == [1.0, 0.75, 0.5]
    args.rule_reward = None
    assert module.shaped_scores(args, rewards, responses, 2).tolist() == [1.0, 0.5, 0.0]
    args.overlong_buffer = 0
    assert module.shaped_scores(args, rewards, responses, 2).tolist() == [1.0, 1.0, 1.0 + missing_eos_penalty]


@pytest.mark.parametrize("module", [grpo, grpo_vllm], ids=["grpo.py", "grpo_vllm.py"])
def test_dapo_leaves_out_a_group_equal_in_accuracy_and_unequal_in_length(module):
    """Two prompts, k = 2 (sample-major rows: [s0 p0, s0 p1, s1 p0, s1 p1]). Prompt 0's answers are both right, one
    ends early and one in the soft zone: their shaped scores differ, and normalised, the length penalty alone would
    weigh as a wrong answer does. Prompt 1's differ in accuracy. DAPO's test is on the rewards: prompt 0's group is
    left out of the loss (and of dynamic sampling's batch), prompt 1's stays."""
    responses, rewards = responses_of([3, 3, 8, 3]), torch.tensor([1.0, 0.0, 1.0, 1.0])
    args = module.Args(loss_type="dapo", overlong_buffer=4, response_length=10, rule_reward="last_number")
    scores = module.shaped_scores(args, rewards, responses, 2)
    assert scores.tolist() == [1.0, 0.0, 0.75, 1.0]
    advantages = module.group_advantages(scores, 2)
    assert advantages[0] > 0.5 and advantages[2] < -0.5  # the length penalty as large as a wrong answer's
    equal = module.groups_of_equal_rewards(rewards, 2)
    assert equal.tolist() == [True, False, True, False]
    mask = module.loss_mask(responses, responses == 0, equal, 2, "dapo", False)
    assert not mask[0].any() and not mask[2].any() and mask[1].any() and mask[3].any()


def test_the_loss_leaves_out_dapos_equal_groups_and_with_overlong_filtering_responses_cut_short():
    # Rows: a response with its stop token (2) then padding (0), one cut short, one in a group of equal scores.
    responses = torch.tensor([[5, 2, 0], [5, 5, 5], [2, 0, 0]])
    padding, equal = responses == 0, torch.tensor([False, False, True])
    mask = grpo.loss_mask(responses, padding, equal, 2, "grpo", False)
    assert mask.tolist() == [[True, True, False], [True, True, True], [True, False, False]]
    assert grpo.loss_mask(responses, padding, equal, 2, "dapo", False).tolist()[2] == [False] * 3
    assert grpo.loss_mask(responses, padding, equal, 2, "grpo", True).tolist()[1] == [False] * 3
    assert grpo.loss_mask(responses, padding, equal, 2, "dapo", True).tolist() == [[True, True, False], [False] * 3,
                                                                                   [False] * 3]


def test_merge_groups_keeps_the_sample_major_layout_and_pads_queries_left_and_responses_right():
    # k = 2. Round 1 kept prompts a, b (queries one token wide, responses two); round 2 prompt c (two and one wide).
    # Rows are sample-major: [s0 a, s0 b, s1 a, s1 b]. The merged batch keeps the first 2 + 1 = 3 prompts, or 2.
    pad = 0
    first = (torch.tensor([[11], [12], [11], [12]]), torch.tensor([[21, 22], [23, 24], [25, 26], [27, 28]]),
             torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.5, 2.5, 3.5, 4.5]))
    second = (torch.tensor([[31, 32], [31, 32]]), torch.tensor([[41], [42]]), torch.tensor([5.0, 6.0]),
              torch.tensor([5.5, 6.5]))
    queries, responses, raw_scores, scores = grpo.merge_groups([first, second], 2, 3, pad)
    assert queries.tolist() == [[0, 11], [0, 12], [31, 32], [0, 11], [0, 12], [31, 32]]
    assert responses.tolist() == [[21, 22], [23, 24], [41, 0], [25, 26], [27, 28], [42, 0]]
    assert raw_scores.tolist() == [1.0, 2.0, 5.0, 3.0, 4.0, 6.0] and scores.tolist() == [1.5, 2.5, 5.5, 3.5, 4.5, 6.5]
    queries, _, raw_scores, _ = grpo.merge_groups([first, second], 2, 2, pad)  # the surplus prompt c dropped
    assert queries.tolist() == [[0, 11], [0, 12], [0, 11], [0, 12]] and raw_scores.tolist() == [1.0, 2.0, 3.0, 4.0]


MATH = ["--rule-reward", "last_number", "--sft-model-path", "assets/tiny_math/sft", "--dataset-name",
        "assets/tiny_math/data", "--eval-every", "0", "--num-eval-prompts", "16"]


@pytest.mark.slow
def test_dynamic_sampling_refills_each_batch_with_varied_groups_and_resumes_exactly(tmp_path):
    """On the math task about half the groups score all 0 or all 1: DAPO's dynamic sampling generates further
    batches of prompts until 16 with differing rewards fill the batch (each update logs how many it took), a checkpoint
    holds the count of batches used, so a resumed run draws the same prompts, one round too few ends in one line, and
    a round may generate several batches at once."""
    whole = tmp_path / "whole"
    result = run_script("grpo.py", "--loss-type", "dapo", *MATH, "--total-episodes", "256", "--save-every", "2",
                        "--output-dir", str(whole))
    assert "--loss-type dapo with --beta 0.0, --cliprange-low 0.2, --cliprange-high 0.28, --overlong-buffer 3, " \
           "--overlong-filter False, --dynamic-sampling-rounds 10" in result.stdout
    assert "one optimizer step per batch: the ratio to the policy before the update is exactly 1, so --loss-type " \
           "dapo's clip has no effect" in result.stdout
    rows = read_metrics(run_dir_of(whole))[1:]
    assert [row["update"] for row in rows] == [1, 2, 3, 4]
    assert all(row["objective/generation_batches"] >= 2 for row in rows)  # half the groups equal: never one batch
    assert all(0.2 < row["objective/equal_score_groups"] < 0.8 for row in rows)

    # Resumed from update 2 (the lines after it are dropped), updates 3 and 4 draw the same prompts again.
    run_script("grpo.py", "--loss-type", "dapo", *MATH, "--total-episodes", "256", "--output-dir", str(whole),
               "--resume", os.path.join(run_dir_of(whole), "checkpoint-2"))
    assert algorithm_metrics(read_metrics(run_dir_of(whole))[1:]) == algorithm_metrics(rows)

    failed = run_script("grpo.py", "--loss-type", "dapo", *MATH, "--total-episodes", "64", "--dynamic-sampling-rounds",
                        "1", "--output-dir", str(tmp_path / "failed"), check=False)
    assert_bad_input_result(failed.returncode, failed.stderr, 0, "--dynamic-sampling-rounds")
    assert "1 batches of prompts gave a rank only" in failed.stderr and "whose 4 rewards differ" in failed.stderr

    # Rounds of 3 batches at once (verl's recipe): one round fills the batch, as half the groups differ.
    run_script("grpo.py", "--loss-type", "dapo", *MATH, "--total-episodes", "128", "--dynamic-sampling-batches", "3",
               "--output-dir", str(tmp_path / "three"))
    batches = [row["objective/generation_batches"] for row in read_metrics(run_dir_of(tmp_path / "three"))[1:]]
    assert batches == [3, 3], batches
