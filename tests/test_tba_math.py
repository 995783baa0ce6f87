"""The maths of TBA against values computed by hand: the trajectory-balance loss and its gradient, beta's annealing,
and the replay buffer (what it keeps, how it draws a training batch, its checkpoint). Each test runs on every copy of
its function among the shipped scripts (tba.py and tba_vllm.py both carry them), so a copy that drifts fails; a
researcher's own copy is free to differ."""

import importlib
import io
import types

import pytest
import torch
from conftest import SHIPPED, definitions


def carriers(name):
    """The shipped scripts that define `name`, found by their code (tba.py and tba_vllm.py)."""
    found = [script.removesuffix(".py") for script in SHIPPED if name in definitions(script)]
    assert len(found) >= 1, name
    return found


@pytest.fixture
def tba(request):
    return importlib.import_module(request.param)


def test_both_tba_scripts_carry_what_these_tests_test():
    assert all(carriers(name) == ["tba", "tba_vllm"] for name in ("tba_loss", "annealed_beta", "ReplayBuffer"))


@pytest.mark.parametrize("tba", carriers("tba_loss"), indirect=True)
def test_the_loss_is_the_variance_of_each_groups_balance_residual_around_its_log_z(tba):
    # Two prompts x k = 2 responses, summed log-probabilities: d = logprobs - ref = [0.5, -1 | -1, 1]; score / beta
    # with beta 0.5 = [2, 0 | 4, 4]; log Z = mean(score / beta - d) = 1.25 and 4; residuals log Z + d - score / beta
    # = [-0.25, 0.25 | -1, 1]; the loss is their mean square, 0.53125.
    logprobs = torch.tensor([-1.0, -2.0, -3.0, -1.0], requires_grad=True)
    loss, log_z = tba.tba_loss(logprobs, torch.tensor([-1.5, -1.0, -2.0, -2.0]), torch.tensor([1.0, 0.0, 2.0, 2.0]),
                               0.5, 2)
    assert loss.item() == pytest.approx(0.53125) and log_z.tolist() == [1.25, 4.0]
    loss.backward()  # log Z has no gradient: d loss / d logprob_i = 2 residual_i / 4
    assert logprobs.grad.tolist() == pytest.approx([-0.125, 0.125, -0.5, 0.5])


@pytest.mark.parametrize("tba", carriers("tba_loss"), indirect=True)
def test_a_group_in_balance_has_no_loss_whatever_its_log_z(tba):
    # d_j = score_j / beta + c for every j of a group: the residuals vanish (log Z = -c), for any behaviour policy.
    scores, ref = torch.tensor([0.3, -1.2, 2.0]), torch.tensor([-4.0, -2.5, -7.0])
    logprobs = ref + scores / 0.1 - 3.0
    loss, log_z = tba.tba_loss(logprobs, ref, scores, 0.1, 3)
    assert loss.item() == pytest.approx(0.0, abs=1e-9) and log_z.item() == pytest.approx(3.0)


@pytest.mark.parametrize("tba", carriers("annealed_beta"), indirect=True)
def test_beta_falls_linearly_to_its_final_value_then_stays_and_can_be_cut_short(tba):
    args = types.SimpleNamespace(beta=1.0, beta_final=0.05, beta_anneal_updates=32, beta_cut_update=0)
    assert [tba.annealed_beta(args, u) for u in (1, 17, 33, 100)] == pytest.approx([1.0, 0.525, 0.05, 0.05])
    assert tba.annealed_beta(types.SimpleNamespace(beta=0.3, beta_final=None, beta_anneal_updates=0,
                                                   beta_cut_update=0), 50) == 0.3
    # TBA's TL;DR (its code): 1.0 falling linearly towards 0.05 over 128 steps, and 0.05 from step 32 on.
    tldr = types.SimpleNamespace(beta=1.0, beta_final=0.05, beta_anneal_updates=128, beta_cut_update=32)
    betas = [tba.annealed_beta(tldr, u) for u in (1, 31, 32, 129, 256)]
    assert betas == pytest.approx([1.0, 1.0 - 0.95 * 30 / 128, 0.05, 0.05, 0.05]) and round(betas[1], 2) == 0.78
    assert sum(tba.annealed_beta(tldr, u) for u in range(1, 32)) / 31 == pytest.approx(0.889, abs=1e-3)


@pytest.mark.parametrize("tba", carriers("ReplayBuffer"), indirect=True)
def test_the_buffer_keeps_each_prompts_newest_unique_responses_and_the_newest_batch_with_its_repeats(tba):
    buffer = tba.ReplayBuffer(3)
    buffer.add([7], [[[1], [2]]], [[0.1, 0.2]], [[-1.0, -2.0]], 0)
    buffer.add([7], [[[2], [3]]], [[0.3, 0.4]], [[-3.0, -4.0]], 1)  # [2] again: it moves to the newest place
    assert buffer.responses[7] == [((1,), 0.1, -1.0, 0), ((2,), 0.3, -3.0, 1), ((3,), 0.4, -4.0, 1)]
    buffer.add([7, 9], [[[4], [4]], [[5], [6]]], [[0.5, 0.5], [0.6, 0.7]], [[-5.0, -5.0], [-6.0, -7.0]], 2)
    assert buffer.responses[7] == [((2,), 0.3, -3.0, 1), ((3,), 0.4, -4.0, 1), ((4,), 0.5, -5.0, 2)]  # 3 newest
    assert buffer.newest[0] == (7, [((4,), 0.5, -5.0, 2), ((4,), 0.5, -5.0, 2)])  # a repeat counts in a batch
    assert sorted(buffer.responses) == [7, 9]


def filled_buffer(tba):
    """Prompts 0-4 seen in an older batch (scores 0 and 1 for two responses each), prompts 5 and 6 the newest."""
    buffer = tba.ReplayBuffer(100)
    buffer.add(list(range(5)), [[[p, 0], [p, 1]] for p in range(5)], [[0.0, 1.0]] * 5, [[-1.0, -1.0]] * 5, 0)
    buffer.add([5, 6], [[[5, 0], [5, 1]], [[6, 0], [6, 1]]], [[0.0, 0.0]] * 2, [[-1.0, -1.0]] * 2, 3)
    return buffer


@pytest.mark.parametrize("tba", carriers("ReplayBuffer"), indirect=True)
def test_a_training_batch_draws_each_group_by_prompt_new_or_from_the_buffer(tba):
    torch.manual_seed(0)
    buffer = filled_buffer(tba)
    groups = buffer.sample(2, 2, recent_prob=1.0, inv_temp=1.0)  # on-policy: the newest batch, each prompt once
    assert sorted(prompt for prompt, _, _ in groups) == [5, 6]
    assert all(not from_buffer and [e[0][0] for e in entries] == [prompt] * 2 for prompt, entries, from_buffer in groups)
    groups = buffer.sample(200, 2, recent_prob=0.0, inv_temp=1.0)
    assert all(from_buffer and all(e[0][0] == prompt for e in entries) for prompt, entries, from_buffer in groups)
    assert {prompt for prompt, _, _ in groups} == set(range(7))  # every prompt seen, the newest among them
    # A prompt with k responses gives each once (without replacement), whatever their scores.
    assert all(sorted(e[0] for e in entries) == [(p, 0), (p, 1)] for p, entries, _ in groups)


@pytest.mark.parametrize("tba", carriers("ReplayBuffer"), indirect=True)
def test_buffered_responses_are_drawn_in_proportion_to_exp_of_inv_temp_times_their_score(tba):
    torch.manual_seed(0)
    buffer = filled_buffer(tba)
    # Prompts 0-4 hold scores 0 and 1: p(score 1) = e^2 / (1 + e^2) = 0.881 at inv_temp 2.
    draws = [entries[0][1] for p, entries, _ in buffer.sample(20000, 1, recent_prob=0.0, inv_temp=2.0) if p < 5]
    assert sum(draws) / len(draws) == pytest.approx(0.881, abs=0.01)
    draws = [entries[0][1] for p, entries, _ in buffer.sample(20000, 1, recent_prob=0.0, inv_temp=0.0) if p < 5]
    assert sum(draws) / len(draws) == pytest.approx(0.5, abs=0.015)  # inv_temp 0: uniformly


@pytest.mark.parametrize("tba", carriers("ReplayBuffer"), indirect=True)
def test_the_buffer_round_trips_through_a_checkpoint_loaded_with_weights_only(tba):
    buffer, restored = filled_buffer(tba), tba.ReplayBuffer(100)
    saved = io.BytesIO()
    torch.save(buffer.state_dict(), saved)
    saved.seek(0)
    restored.load_state_dict(torch.load(saved, weights_only=True))
    assert (restored.newest, restored.responses) == (buffer.newest, buffer.responses)
    torch.manual_seed(1)
    first = buffer.sample(8, 2, 0.5, 1.0)
    torch.manual_seed(1)
    assert restored.sample(8, 2, 0.5, 1.0) == first
