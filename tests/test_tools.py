"""grpo_tools_vllm.py, episodes of turns with a calculator: the calculator's parser (safe, exact, errors as None), the
environment's steps and the reward on the final answer; token in, token out (what the learner trains on is, position
by position, what vLLM sampled and what the environment appended, the environment's tokens out of the loss, each
policy token's behaviour log-probability vLLM's); learning on the tiny tool task, and its exact resume."""

import builtins
import json
import os
import shutil

import pytest
import torch
from conftest import ROOT, algorithm_metrics, read_metrics, run_dir_of, run_patched, run_script
from transformers import AutoTokenizer

from calculator import calculate
from data import load_tokenizer

TOOLS = os.path.join(ROOT, "assets", "tiny_tools")


def test_the_calculator_computes_arithmetic_exactly(monkeypatch):
    monkeypatch.setattr(builtins, "eval", None)  # never used: a call would fail
    cases = {"47*8": "376", "47 + 38": "85", "(1+2)*3": "9", "-4+2": "-2", "2*-3": "-6", "--2": "2", "1/3": "0.333333",
             "3.5*2": "7", "7/2": "3.5", "10-2-3": "5", "8/4/2": "1", "2+3*4": "14", "((2))": "2", "0.1+0.2": "0.3"}
    assert {expression: calculate(expression) for expression in cases} == cases


@pytest.mark.parametrize("expression", [
    "", " ", "1+", "*2", "(1+2", "1+2)", "1 2", "2**10", "2^10", "1e3", "x+1", "abs(-1)", "__import__('os')",
    "open('/etc/passwd')", "1/0", "1/(2-2)", "9" * 11, "1+" * 32 + "1", "٣+1", "1_000", "0x10", "1,5", "=1"])
def test_the_calculator_refuses_anything_else_with_none(expression):
    """Names, calls, powers, other numerals, division by zero, unbalanced parentheses, too long an expression or too
    many digits: None (the environment's `error`), never an exception or a value."""
    assert calculate(expression) is None


@pytest.fixture(scope="module")
def env():
    import grpo_tools_vllm

    args = grpo_tools_vllm.Args(max_turns=2)
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TOOLS, "sft"))
    return grpo_tools_vllm, grpo_tools_vllm.make_calculator(args, tokenizer, tokenizer.eos_token_id), tokenizer


def test_a_call_gets_its_result_a_malformed_one_an_error_and_any_other_turn_ends_the_episode(env):
    script, calculator, tokenizer = env
    ids = tokenizer.encode
    assert script.environment_step(calculator, ids("<calc>47*8</calc>"), 1, 20) == (ids("<result>376</result>"), False)
    assert script.environment_step(calculator, ids("<calc>47*</calc>"), 1, 20) == (ids("<result>error</result>"), False)
    assert script.environment_step(calculator, ids("47*8</calc>"), 1, 20) == (ids("<result>error</result>"), False)
    assert script.environment_step(calculator, ids("<calc>47*8</calc>"), 2, 20) == ([], True)  # --max-turns 2
    assert script.environment_step(calculator, ids("Answer: 376") + [tokenizer.eos_token_id], 1, 20) == ([], True)
    assert script.environment_step(calculator, ids("Answer: 37"), 1, 0) == ([], True)  # --response-length spent
    assert script.environment_step(calculator, ids("<calc>47*8</calc>"), 1, 3) == (ids("<result>376</result>")[:3],
                                                                                   True)  # the result fills the episode


@pytest.mark.slow  # (the smollm2 fixture builds the model on first use)
def test_gsm8ks_calculator_format_fits_a_chat_models_tokenizer_and_an_end_of_several_tokens_stops_in_one_line(
        smollm2, capsys):
    """SmolLM2's tokenizer has no tool tokens: GSM8K's format (a call `<<47*38=`, its result `1786>>`) ends a call and
    a result with one token each, and validates (a result needs no text before its value); the default `</calc>` is
    three tokens there, found once the tokenizer has loaded, in one line naming --tool-call."""
    import grpo_tools_vllm as script

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(smollm2, "model"))
    args = script.Args(tool_call="<<{}=", tool_result="{}>>")
    args.world_size = 1
    script.validate(args)
    calculator = script.make_calculator(args, tokenizer, tokenizer.eos_token_id)

    def ids(text):
        return tokenizer.encode(text, add_special_tokens=False)

    assert script.environment_step(calculator, ids("I compute <<47*38="), 1, 20) == (ids("1786>>"), False)
    assert script.environment_step(calculator, ids("47*38="), 1, 20) == (ids("error>>"), False)
    with pytest.raises(SystemExit) as exit:
        script.make_calculator(script.Args(), tokenizer, tokenizer.eos_token_id)
    assert exit.value.code == 2
    assert capsys.readouterr().err.startswith("error: --tool-call: '</calc>' is 3 tokens of the policy's tokenizer")


def test_the_reward_reads_the_final_answer_of_an_answered_episode_only(env):
    """A number the calculator wrote is not the policy's answer; an episode without the stop token has none."""
    script, calculator, tokenizer = env
    args = script.Args()
    eos = tokenizer.eos_token
    episodes = {"<calc>47*8</calc><result>376</result>\nAnswer: 376" + eos: 1.0,
                "<calc>47*8</calc><result>376</result>\nAnswer:" + eos: 0.0,
                "<calc>47*8</calc><result>376</result>\nAnswer: 376": 0.0,
                "<calc>376</calc>": 0.0, "Answer: 376" + eos: 1.0, "Answer: 377" + eos: 0.0}
    query = tokenizer.encode("Question: What is 47 * 8?\n")
    rows = [query + tokenizer.encode(text) for text in episodes]
    batch = torch.full((len(rows), max(map(len, rows))), tokenizer.pad_token_id)
    for i, row in enumerate(rows):
        batch[i, : len(row)] = torch.tensor(row)
    scores = script.score_episodes(calculator, args, None, batch, len(query), ["376"] * len(rows), tokenizer)
    assert scores.tolist() == list(episodes.values())


def test_the_tool_metrics_count_turns_calls_errors_and_the_turn_limit(env):
    script, calculator, tokenizer = env
    ids, eos = tokenizer.encode, [tokenizer.eos_token_id]
    call, result, error, answer = (ids("<calc>47*8</calc>"), ids("<result>376</result>"), ids("<result>error</result>"),
                                   ids("\nAnswer: 376") + eos)
    episodes = [(call + result + answer, [1] * len(call) + [0] * len(result) + [1] * len(answer)),
                (call + error + call, [1] * len(call) + [0] * len(error) + [1] * len(call)),  # ends at the limit
                (ids("Answer: 376") + eos, [1] * (len(ids("Answer: 376")) + 1))]
    metrics = script.tool_metrics(calculator, [e for e, _ in episodes], [m for _, m in episodes],
                                  torch.tensor([1.0, 0.0, 0.0]))
    assert metrics == pytest.approx({
        "tools/turns": 5 / 3, "tools/calls": 3 / 3, "tools/errors": 1 / 3, "tools/turn_limit": 1 / 3,
        "tools/environment_tokens": (len(result) + len(error)) / 3, "tools/tool_rate": 2 / 3,
        "tools/accuracy_with_tool": 1 / 2, "tools/accuracy_without_tool": 0.0})


# The script run with spies on what it calls: vLLM's turns (generate_batch: each turn's contexts, the ids and
# log-probabilities vLLM returned and the LoRA adapter it was given), the log-probabilities' inputs (the ids the
# learner scores), the importance weights' (behaviour log-probabilities and mask, in the batch's order) and the loss's
# mask (in the training step's order).
TOKEN_SPY = """
import json, sys
import grpo_tools_vllm as script
turns, weighted, trained, last = [], [], [], {}
generate, logprobs, weights, loss = (script.generate_batch, script.response_logprobs, script.importance_weights,
                                     script.grpo_policy_loss)

def spy_generate(llm, prompts, k, sampling, adapter=None):
    outputs = generate(llm, prompts, k, sampling, adapter)
    turns.append([prompts, outputs, getattr(adapter, "lora_name", None)])
    return outputs

def spy_logprobs(logits, responses, temperature):
    last["responses"] = responses.tolist()
    return logprobs(logits, responses, temperature)

def spy_weights(proximal, behaviour, mask, *rest):
    weighted.append([last["responses"], behaviour.tolist(), mask.int().tolist()])
    return weights(proximal, behaviour, mask, *rest)

def spy_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, *rest):
    trained.append([last["responses"], mask.int().tolist()])
    return loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, *rest)

script.generate_batch, script.response_logprobs = spy_generate, spy_logprobs
script.importance_weights, script.grpo_policy_loss = spy_weights, spy_loss
script.save_checkpoint = lambda *args, **kwargs: None  # no test reads it (SmolLM2's: 2.6 GB)
sys.argv = ["grpo_tools_vllm.py", *sys.argv[1:]]
script.main(script.parse_arguments(script.Args))
print("RECORD " + json.dumps({"turns": turns, "weighted": weighted, "trained": trained}), flush=True)
"""


def expected_episodes(turns):
    """Each episode as vLLM sampled it and the environment appended to it, from vLLM's turns alone: turn 1's ids, then
    for an episode vLLM went on with (its context of turn 2 starts with its prompt and turn 1), what that context
    holds after them (the environment's ids) and turn 2's ids. (ids, mask: 1 sampled, 0 appended, behaviour
    log-probabilities: vLLM's, 0 appended) per episode, and how many had two turns."""
    (prompts, first, _), *later = turns
    episodes = [[list(tokens), [1] * len(tokens), list(logprobs)] for tokens, logprobs in first]
    assert len(later) <= 1, "--max-turns 2"
    start = 0
    for context, (tokens, logprobs) in zip(*later[0][:2]) if later else []:
        n = next(n for n in range(start, len(episodes)) if context[: len(prompts[n]) + len(episodes[n][0])]
                 == prompts[n] + episodes[n][0])  # the live episodes keep their order
        appended = context[len(prompts[n]) + len(episodes[n][0]):]
        episodes[n] = [episodes[n][0] + appended + tokens, episodes[n][1] + [0] * len(appended) + [1] * len(tokens),
                       episodes[n][2] + [0.0] * len(appended) + logprobs]
        start = n + 1
    return episodes, len(later[0][0]) if later else 0


def padded(values, width, pad):
    return values + [pad] * (width - len(values))


# SmolLM2 as it ships (tied embeddings, pad == EOS, a chat template) on its sums, with a call it writes untaught: a turn
# ends at ` =` (one token of its tokenizer, as in `1 + 3 = 4`), the calculator reads what follows the last `+` (` 3`)
# and appends ` 3.`, whose tokens the policy goes on from.
SMOLLM2_TOOLS = ["--dataset-name", "assets/smollm2/data", "--tool-call", "+{} =", "--tool-result", " {}."]


@pytest.mark.slow
@pytest.mark.parametrize("model,lora", [("tiny", []), ("tiny", ["--lora-rank", "8"]), ("smollm2", [])],
                         ids=["full", "lora", "smollm2"])
def test_the_learner_trains_on_the_ids_vllm_sampled_and_the_environment_appended_its_tokens_masked(
        tmp_path, request, model, lora):
    """A batch of 32 episodes of at most two turns (--sync: vLLM samples with the learner's weights): the ids each
    training row holds and its loss mask equal, position by position, vLLM's turns and the environment's result
    between them, with 0 on every appended token and on the padding; the importance weights get the same mask and, as
    behaviour log-probabilities, vLLM's for the policy's tokens; the mismatch is vLLM's numerical one alone. With LoRA,
    every turn is sampled under the policy's adapter (version 0's), not the base model. On the tiny tool task and on
    SmolLM2."""
    path = os.path.join(TOOLS, "sft") if model == "tiny" else os.path.join(request.getfixturevalue("smollm2"), "model")
    task = [] if model == "tiny" else ["--sft-model-path", path, *SMOLLM2_TOOLS]
    result, errors = run_patched(TOKEN_SPY, *task, *lora, "--max-turns", "2", "--k", "4", "--total-episodes", "32",
                                 "--per-device-train-batch-size", "32", "--sync", "--eval-every", "0",
                                 "--num-eval-prompts", "8", "--vllm-enforce-eager", "--output-dir", str(tmp_path))
    assert result.returncode == 0 and not errors, result.stderr[-3000:]
    record = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("RECORD "))[7:])
    assert {adapter for _, _, adapter in record["turns"]} == {"policy-0" if lora else None}
    episodes, two_turns = expected_episodes(record["turns"])
    assert len(episodes) == 32 and two_turns >= 2, two_turns  # the tiny SFT policy calls the tool in about 30 %
    pad = load_tokenizer(path, False).pad_token_id  # SmolLM2's own is EOS: the script's [PAD], past its vocabulary
    (responses, mask), = record["trained"]  # one step: the rows in the step's order
    width = len(responses[0])
    expected = sorted((padded(ids, width, pad), padded(own, width, 0)) for ids, own, _ in episodes)
    assert sorted(zip(responses, mask)) == expected
    (responses, behaviour, mask), = record["weighted"]  # the batch's order, vLLM's
    assert [(row, own) for row, own in zip(responses, mask)] == [
        (padded(ids, width, pad), padded(own, width, 0)) for ids, own, _ in episodes]
    for row, (_, _, logprobs) in zip(behaviour, episodes):
        assert row == pytest.approx(padded(logprobs, width, 0.0), rel=1e-6, abs=1e-7)
    rows = read_metrics(run_dir_of(tmp_path))
    assert rows[1]["async/mismatch_kl"] < 1e-4 and rows[1]["tools/environment_tokens"] > 0, rows[1]


# The tiny tool task: LEARN_UPDATES updates of 64 episodes (16 prompts x 4) at most two turns each, one update late
# (K = 1), saving at RESUMED_AT on the way; then resumed from there as a kill after that checkpoint leaves the run (its
# later files gone), with the batch generated for the next update (by policy RESUMED_AT - 1) kept in the checkpoint.
LEARN_UPDATES, RESUMED_AT = 16, 14
LEARN = ["grpo_tools_vllm.py", "--max-turns", "2", "--learning-rate", "3e-4", "--total-episodes",
         str(64 * LEARN_UPDATES),
         "--per-device-train-batch-size", "64", "--eval-every", str(LEARN_UPDATES), "--num-eval-prompts", "64",
         "--save-every", str(RESUMED_AT), "--vllm-enforce-eager"]


@pytest.mark.slow
def test_the_tiny_tool_task_raises_accuracy_and_tool_use_and_resumes_exactly(tmp_path):
    run_script(*LEARN, "--output-dir", str(tmp_path / "runs"))
    run_dir = run_dir_of(tmp_path / "runs")
    rows = read_metrics(run_dir)
    assert [row["update"] for row in rows] == list(range(LEARN_UPDATES + 1))
    first, last = rows[1:4], rows[-3:]

    def mean(rows, key):
        return sum(row[key] for row in rows) / len(rows)

    rates = [row["tools/tool_rate"] for row in rows[1:]]
    assert mean(last, "tools/tool_rate") > mean(first, "tools/tool_rate") + 0.3, rates
    assert mean(last, "objective/raw_scores") > mean(first, "objective/raw_scores") + 0.2
    assert rows[-1]["eval/scores"] > rows[0]["eval/scores"] + 0.2, (rows[0]["eval/scores"], rows[-1]["eval/scores"])
    assert all(row["tools/accuracy_with_tool"] > row["tools/accuracy_without_tool"] for row in rows[1:])
    resumed = tmp_path / "resumed" / os.path.basename(run_dir)
    shutil.copytree(run_dir, resumed, ignore=shutil.ignore_patterns(f"checkpoint-{LEARN_UPDATES}"))
    with open(resumed / f"checkpoint-{RESUMED_AT}" / "generated_batches.json") as f:
        (kept,) = json.load(f)  # episodes in flight, with which of their tokens the environment appended
    assert kept["version"] == RESUMED_AT - 1 and any(0 in own for rank in kept["sampled"] for own in rank)
    run_script(*LEARN, "--resume", str(resumed / f"checkpoint-{RESUMED_AT}"))
    expected, got = algorithm_metrics(rows), algorithm_metrics(read_metrics(resumed))
    assert [row["update"] for row in got] == list(range(LEARN_UPDATES + 1))
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)


@pytest.mark.slow
def test_two_ranks_train_their_own_episodes_and_resume_them_exactly(tmp_path):
    """Two DeepSpeed ranks, vLLM on rank 0 playing both ranks' episodes, one update late and the weights checked at
    every hand-off: four updates of 2 x 16 episodes; resumed from checkpoint-2, whose batch in flight holds each
    rank's episodes with the environment's tokens marked, updates 3 and 4 are the uninterrupted run's."""
    from test_scripts_run import free_port, launch_two_processes

    command = ["grpo_tools_vllm.py", "--max-turns", "2", "--per-device-train-batch-size", "16", "--total-episodes",
               "128", "--save-every", "2", "--check-weights-every", "1", "--eval-every", "0", "--num-eval-prompts", "32",
               "--vllm-enforce-eager", "--output-dir", str(tmp_path / "run")]
    launch_two_processes(tmp_path, free_port(), command, nodes=1)
    run_dir = run_dir_of(tmp_path / "run")
    rows = read_metrics(run_dir)
    assert [row["update"] for row in rows] == list(range(5)) and rows[-1]["episode"] == 128
    assert [row["async/off_policy_steps"] for row in rows[1:]] == [0, 1, 1, 1]
    assert all(row["tools/environment_tokens"] > 0 for row in rows[1:])
    with open(os.path.join(run_dir, "checkpoint-2", "generated_batches.json")) as f:
        (kept,) = json.load(f)
    assert len(kept["sampled"]) == 2 and all(any(0 in own for own in rank) for rank in kept["sampled"])
    resumed = tmp_path / "resumed" / os.path.basename(run_dir)
    shutil.copytree(run_dir, resumed, ignore=shutil.ignore_patterns("checkpoint-4"))
    launch_two_processes(tmp_path, free_port(), [*command, "--resume", str(resumed / "checkpoint-2")], nodes=1)
    expected, got = algorithm_metrics(rows), algorithm_metrics(read_metrics(resumed))
    assert [row["update"] for row in got] == list(range(5))
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)
