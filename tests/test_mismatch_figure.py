"""async/mismatch_kl of best-of-k's asynchronous script: vLLM's (behaviour) log-probabilities of every response of the
batch against the learner's of step 2, before the update, as rloo_vllm.py, ppo_vllm.py and grpo_vllm.py compute it
(not of the best responses only, which left most of the batch's tokens out of the figure). Online DPO computes the
learner's log-probabilities of its pairs only, and TBA's of the newest batch in one more forward: each keeps its own."""

import ast
import math

import pytest
import torch
from conftest import definitions

import bok_vllm

# The scripts whose step 2 computes the learner's log-probabilities of the whole batch (`logprobs`).
WHOLE_BATCH = ["rloo_vllm.py", "ppo_vllm.py", "grpo_vllm.py", "bok_vllm.py"]


def _mismatch_call(script):
    """The arguments of the mismatch_kl call logged as async/mismatch_kl (streaming adds others, over some responses)."""
    (call,) = [value for node in ast.walk(definitions(script)["main"][0]) if isinstance(node, ast.Dict)
               for key, value in zip(node.keys, node.values)
               if isinstance(key, ast.Constant) and key.value == "async/mismatch_kl"]
    return ", ".join(ast.unparse(argument) for argument in call.args)


@pytest.mark.parametrize("script", WHOLE_BATCH)
def test_the_figure_takes_every_response_of_the_batch(script):
    assert _mismatch_call(script) == "logprobs, behaviour_logprobs, ~padding_mask", script


def test_every_response_counts_by_hand():
    # k = 2 samples of 2 prompts (sample j of prompt i is row j * 2 + i), two tokens each, the last row's second one
    # padding. The best responses (rows 0 and 3) agree with vLLM; rows 1 and 2 do not, by log 2 and -log 2 a token.
    behaviour = torch.zeros(4, 2)
    proximal = torch.tensor([[0.0, 0.0], [math.log(2)] * 2, [-math.log(2)] * 2, [0.0, 5.0]])
    mask = torch.tensor([[True, True], [True, True], [True, True], [True, False]])
    best, has_best = bok_vllm.select_best(torch.tensor([1.0, 0.0, 0.0, 1.0]), 2)
    assert best.tolist() == [0, 3] and has_best.all()
    assert bok_vllm.mismatch_kl(proximal[best], behaviour[best], mask[best]) == 0.0  # the best alone: no mismatch
    # Every response token: 3 of 7 agree, 2 have r = 2 (r - 1 - log r = 1 - log 2), 2 have r = 1/2 (log 2 - 1/2).
    expected = (2 * (1 - math.log(2)) + 2 * (math.log(2) - 0.5)) / 7
    assert bok_vllm.mismatch_kl(proximal, behaviour, mask) == pytest.approx(expected)  # 0.143
