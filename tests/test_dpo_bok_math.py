"""The pair selection and losses of online_dpo.py and the selection and loss of bok.py, by hand."""

import math

import torch

import bok
import online_dpo

STOP, PAD = 0, 1


def test_pairs_are_the_highest_and_lowest_score_and_ties_go_to_the_first_sample():
    # k = 3 samples of 3 prompts, stored sample-major: index j * 3 + i is sample j of prompt i.
    scores = torch.tensor([
        1.0, 0.5, 3.0,  # sample 0
        2.0, 0.5, -1.0,  # sample 1
        2.0, 0.5, 3.0,  # sample 2
    ])
    chosen, rejected = online_dpo.select_pairs(scores, 3)
    # Prompt 0: samples 1 and 2 tie for the best -> sample 1 (index 3); the worst is sample 0.
    # Prompt 1: all equal -> paired with itself (sample 0, index 1).
    # Prompt 2: samples 0 and 2 tie for the best -> sample 0 (index 2); the worst is sample 1 (index 5).
    assert chosen.tolist() == [3, 1, 2]
    assert rejected.tolist() == [0, 1, 5]


def test_the_missing_eos_penalty_can_turn_a_pair_around():
    # k = 2 samples of one prompt: sample 0 scores higher but never stops.
    responses = torch.tensor([[5, 6, 7], [5, STOP, PAD]])
    scores = online_dpo.apply_missing_eos_penalty(torch.tensor([1.0, 0.5]), responses, STOP, -1.0, "add")
    chosen, rejected = online_dpo.select_pairs(scores, 2)
    assert scores.tolist() == [0.0, 0.5] and chosen.tolist() == [1] and rejected.tolist() == [0]


def test_dpo_sigmoid_loss_and_its_gradient():
    chosen = torch.tensor([1.0, -0.5], requires_grad=True)  # sequence log pi - log ref
    rejected = torch.tensor([0.0, 0.5], requires_grad=True)
    loss = online_dpo.dpo_loss(chosen, rejected, beta=0.1, loss_type="sigmoid")
    # Margins 1 and -1: -log sigmoid(0.1) and -log sigmoid(-0.1), averaged.
    expected = (math.log(1 + math.exp(-0.1)) + math.log(1 + math.exp(0.1))) / 2
    assert math.isclose(loss.item(), expected, rel_tol=1e-6)
    loss.backward()
    # d/d chosen = -beta * sigmoid(-beta * margin) / num_pairs; the rejected gradient is its negative.
    sigmoid = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    grad = [-0.1 * sigmoid(-0.1) / 2, -0.1 * sigmoid(0.1) / 2]
    assert torch.allclose(chosen.grad, torch.tensor(grad)) and torch.allclose(rejected.grad, -torch.tensor(grad))


def test_ipo_loss_regresses_the_margin_to_one_over_two_beta():
    chosen = torch.tensor([1.0, -0.5], requires_grad=True)
    rejected = torch.tensor([0.0, 0.5])
    loss = online_dpo.dpo_loss(chosen, rejected, beta=0.1, loss_type="ipo")
    assert math.isclose(loss.item(), ((1 - 5) ** 2 + (-1 - 5) ** 2) / 2, rel_tol=1e-6)  # 26
    loss.backward()
    assert torch.allclose(chosen.grad, torch.tensor([2 * (1 - 5) / 2, 2 * (-1 - 5) / 2]))


def test_before_any_update_the_sigmoid_loss_is_log_2_and_ipo_is_one_over_four_beta_squared():
    zeros = torch.zeros(4)  # the policy is the reference: every log-ratio is zero
    assert math.isclose(online_dpo.dpo_loss(zeros, zeros, 0.1, "sigmoid").item(), math.log(2), rel_tol=1e-6)
    assert math.isclose(online_dpo.dpo_loss(zeros, zeros, 0.1, "ipo").item(), 25.0, rel_tol=1e-6)


def test_a_prompt_paired_with_itself_has_no_gradient():
    logratios = torch.tensor([0.3, -0.7], requires_grad=True)
    same = torch.tensor([0, 1])
    for loss_type in ("sigmoid", "ipo"):
        logratios.grad = None
        online_dpo.dpo_loss(logratios[same], logratios[same], 0.1, loss_type).backward()
        assert logratios.grad.abs().max().item() == 0.0


def test_best_of_k_keeps_the_highest_score_and_the_first_of_ties():
    scores = torch.tensor([1.0, 0.5, 3.0, 2.0, 0.5, -1.0, 2.0, 0.5, 3.0])  # k = 3 samples of 3 prompts
    best, has_best = bok.select_best(scores, 3)
    assert best.tolist() == [3, 1, 2] and has_best.tolist() == [True, False, True]  # prompt 1: 0.5 three times
    # A response without a stop token loses its lead to the penalty.
    responses = torch.tensor([[5, 6, 7], [5, STOP, PAD]])
    penalised = bok.apply_missing_eos_penalty(torch.tensor([1.0, 0.5]), responses, STOP, -1.0, "add")
    assert bok.select_best(penalised, 2)[0].tolist() == [1]
    # 0/1 rule rewards of k = 2 samples of 4 prompts: all wrong and all right have no best.
    best, has_best = bok.select_best(torch.tensor([0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0]), 2)
    assert best.tolist() == [0, 1, 6, 3] and has_best.tolist() == [False, False, True, True]


def test_best_of_k_leaves_prompts_without_a_best_response_out_of_the_loss():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -5.0]], requires_grad=True)
    padding = torch.tensor([[False, False], [False, True]])
    has_best = torch.tensor([False, True])
    loss = bok.sft_loss(logprobs.masked_fill(padding, 0.0), padding | ~has_best[:, None])
    loss.backward()
    assert loss.item() == 3.0 and logprobs.grad[0].abs().sum().item() == 0.0  # only prompt 1's one token


def test_best_of_k_loss_is_the_mean_negative_log_likelihood_per_response_token():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0]], requires_grad=True)
    padding = torch.tensor([[False, False, True], [False, True, True]])  # 2 + 1 real tokens
    loss = bok.sft_loss(logprobs, padding)
    assert math.isclose(loss.item(), (1 + 2 + 3) / 3, rel_tol=1e-6)
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-1 / 3, -1 / 3, 0.0], [-1 / 3, 0.0, 0.0]]))


def test_best_of_k_loss_per_sequence_sums_each_responses_tokens_as_the_papers_code():
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-7.0, -7.0, -7.0]], requires_grad=True)
    padding = torch.tensor([[False, False, True], [False, True, True], [True, True, True]])  # row 2: left out
    loss = bok.sft_loss(logprobs, padding, "sequence")
    assert math.isclose(loss.item(), ((1 + 2) + 3) / 2, rel_tol=1e-6)  # two responses, each summed
    loss.backward()
    assert torch.allclose(logprobs.grad, torch.tensor([[-0.5, -0.5, 0.0], [-0.5, 0.0, 0.0], [0.0, 0.0, 0.0]]))
    assert bok.sft_loss(logprobs, torch.ones(3, 3, dtype=torch.bool), "sequence").item() == 0.0  # nothing kept
