"""What a deliberate bug once changed unseen (issue 64, M4-M7): DAPO's equal-group filter given the shaped scores at
its call sites, the algorithm functions that shipped scripts share drifting apart, the seeding removed, the
off-policy correction's options and mask boundary, and the divergence check in every script's loop; and (M8) the
*_vllm.py's LoRA lines, which only two of them run with an adapter in the tests."""

import ast
import collections
import json
import math
import os
import re
import sys
import typing

import pytest
import torch

import grpo_vllm
import ppo_vllm
import rloo_vllm
from conftest import ALGORITHMS, SHIPPED, TINY, definitions, forked_runs, read_metrics, run_dir_of, run_patched
from test_layout import DETAILS


def calls_in(node, name):
    """The calls to the function `name` (a plain name, or a method of that name) under `node`."""
    return [c for c in ast.walk(node) if isinstance(c, ast.Call) and (getattr(c.func, "id", None) == name
                                                                      or getattr(c.func, "attr", None) == name)]


def update_loop(script):
    main = definitions(script)["main"][0]
    return next(node for node in ast.walk(main) if isinstance(node, ast.For) and getattr(node.target, "id", None)
                == "update")


# ---------------------------------------------------------------------------------------------------------------------
# M4. DAPO tests a group's rewards before the missing-EOS penalty and the overlong shaping (grpo.py's docstring of
# groups_of_equal_rewards says why). The helper is tested in test_grpo_math.py; here its call sites.

GRPO_FAMILY = [s for s in SHIPPED if {"groups_of_equal_rewards", "shaped_scores"} <= definitions(s).keys()]

SPY = """
import json, sys
import {name} as script
calls = []
equal_rewards, shaped = script.groups_of_equal_rewards, script.shaped_scores

def spy_equal(rewards, k):
    calls.append(["equal", rewards.tolist()])
    return equal_rewards(rewards, k)

def spy_shaped(args, rewards, responses, stop_token_id):
    scores = shaped(args, rewards, responses, stop_token_id)
    calls.append(["shaped", rewards.tolist(), scores.tolist()])
    return scores

script.groups_of_equal_rewards, script.shaped_scores = spy_equal, spy_shaped
sys.argv = ["{name}.py", *sys.argv[1:]]
try:
    script.main(script.parse_arguments(script.Args))
finally:
    print("CALLS " + json.dumps(calls), flush=True)
"""

MATH = ["--rule-reward", "last_number", "--sft-model-path", "assets/tiny_math/sft", "--dataset-name",
        "assets/tiny_math/data", "--eval-every", "0", "--num-eval-prompts", "16"]


def test_grpo_family_filters_equal_groups_on_the_rewards_that_shaping_starts_from():
    """Every call of groups_of_equal_rewards in main takes the rewards that shaped_scores is given, never its result
    (the shipped GRPO scripts; grpo_vllm.py's run takes minutes to start vLLM, so its call site is read here)."""
    assert GRPO_FAMILY == ["grpo.py", "grpo_vllm.py"]
    for script in GRPO_FAMILY:
        main = definitions(script)["main"][0]
        shaping = [node for node in ast.walk(main) if isinstance(node, ast.Assign) and calls_in(node.value,
                                                                                              "shaped_scores")]
        assert len(shaping) == 1, script
        rewards = ast.unparse(calls_in(shaping[0].value, "shaped_scores")[0].args[1])
        shaped = ast.unparse(shaping[0].targets[0])
        filtered = [ast.unparse(call.args[0]) for call in calls_in(main, "groups_of_equal_rewards")]
        assert filtered and all(name == rewards != shaped for name in filtered), \
            f"{script}: groups_of_equal_rewards({', '.join(filtered)}); DAPO's test is on {rewards}, not {shaped}"


@pytest.mark.slow
def test_a_dapo_run_with_every_response_in_the_overlong_buffer_filters_on_the_rule_rewards(tmp_path):
    """grpo.py, one update of DAPO on the math task with a buffer as long as the responses may be: every response
    loses 0.5 x its length / 16 to the overlong shaping, so no shaped score is the rule's 0 or 1. Both call sites of
    the filter (dynamic sampling's count and the loss mask) must see the rule's 0/1 rewards, the very ones shaping
    was given (about 20 s)."""
    result, errors = run_patched(SPY.format(name="grpo"), "--loss-type", "dapo", "--overlong-buffer", "16",
                                 "--response-length", "16", "--dynamic-sampling-rounds", "0", *MATH,
                                 "--total-episodes", "64", "--output-dir", str(tmp_path))
    assert result.returncode == 0 and not errors, result.stderr[-3000:]
    calls = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("CALLS "))[6:])
    (rewards, scores), = [call[1:] for call in calls if call[0] == "shaped"]
    assert set(rewards) == {0.0, 1.0} and not set(scores) & {0.0, 1.0}  # the buffer reached every response
    filtered = [call[1] for call in calls if call[0] == "equal"]
    assert len(filtered) == 2 and all(seen == rewards for seen in filtered), (filtered, rewards, scores)


# ---------------------------------------------------------------------------------------------------------------------
# M5. The functions that two or more shipped algorithm scripts define are the same source in each (as the RLHF details
# are: tests/test_layout.py), but for these, which differ on purpose. A researcher's copy is not compared.

MAY_DIFFER = {
    "Args": "each script's own arguments",
    "main": "each script's own loop",
    "validate": "each script's checks of its own arguments",
    "rloo_policy_loss": "the *_vllm.py loss weights each response by its importance weight "
                        "(test_off_policy_correction.py: with weights of 1 it is rloo.py's)",
    "ppo_policy_loss": "the *_vllm.py loss weights each token by its importance weight (as above)",
    "grpo_policy_loss": "the *_vllm.py loss weights each token's policy term by its importance weight (as above)",
}
SHIPPED_ALGORITHMS = [s for s in SHIPPED if s in ALGORITHMS]


def shared_definitions():
    """{name: {script: source}} of the names that two or more shipped algorithm scripts define."""
    found = collections.defaultdict(dict)
    for script in SHIPPED_ALGORITHMS:
        for name, (_, source) in definitions(script).items():
            found[name][script] = source
    return {name: sources for name, sources in found.items() if len(sources) > 1}


SHARED = shared_definitions()


def test_the_shipped_scripts_are_the_twelve_algorithms_and_what_may_differ_is_shared():
    assert len(SHIPPED_ALGORITHMS) == 12
    stale = sorted(set(MAY_DIFFER) - set(SHARED))
    assert not stale, f"MAY_DIFFER lists names no longer defined by two shipped scripts: {stale}"
    assert {"importance_weights", "mismatch_kl", "proximal_mean", "generating_version", "annealed_beta",
            "groups_of_equal_rewards"} <= set(SHARED)


@pytest.mark.parametrize("name", sorted(set(SHARED) - set(MAY_DIFFER) - DETAILS))
def test_the_shipped_scripts_share_each_algorithm_function_they_have_in_common(name):
    """A function changed in one shipped script is changed in every one that defines it (importance_weights in
    rloo_vllm, ppo_vllm and grpo_vllm, mismatch_kl and generating_version in six, annealed_beta in tba and tba_vllm)."""
    versions = collections.defaultdict(list)
    for script, source in SHARED[name].items():
        versions[source].append(script)
    if len(versions) > 1:
        groups = sorted(versions.values(), key=len)
        pytest.fail(f"{name} differs among the shipped scripts: {', '.join(groups[0])} against "
                    f"{'; '.join(', '.join(g) for g in groups[1:])}. Change them together: "
                    f"`python tests/sync_detail.py {name} {groups[0][0]}` copies {groups[0][0]}'s {name} to every "
                    f"shipped script that defines it; or, if they must differ, list {name} in MAY_DIFFER with why.")


# ---------------------------------------------------------------------------------------------------------------------
# M6. The seed chooses the sampled responses, not only the prompts' order: on a data set of one prompt repeated, where
# the order changes nothing, seed 1 twice gives the same run and seed 2 another.

@pytest.mark.slow
def test_the_seed_chooses_the_sampled_responses(tmp_path):
    """rloo.py, one update, three runs forked from one process (about 60 s): seeds 1, 2, 1."""
    row = open(os.path.join(TINY, "data", "train.jsonl")).readline()
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(row * 64)
    (data / "test.jsonl").write_text(row * 8)
    cases = [["--dataset-name", str(data), "--seed", str(seed), "--total-episodes", "64", "--eval-every", "0",
              "--num-eval-prompts", "8", "--output-dir", str(tmp_path / f"run{i}")] for i, seed in enumerate([1, 2, 1])]
    results = forked_runs("rloo.py", cases, tmp_path / "results.json")
    assert [r[0] for r in results] == [0, 0, 0], [r[2][-2000:] for r in results]
    keys = ("objective/scores", "objective/entropy", "val/response_length", "loss/policy_avg")
    first, second, again = [{k: read_metrics(run_dir_of(tmp_path / f"run{i}"))[-1][k] for k in keys} for i in range(3)]
    assert first == again, "the same seed, another run"
    assert first["objective/scores"] != second["objective/scores"] and \
        first["objective/entropy"] != second["objective/entropy"], f"seeds 1 and 2 sampled alike: {first}"


# ---------------------------------------------------------------------------------------------------------------------
# M7. The off-policy correction: mask mode's boundary, the options as the loop passes them; the divergence check.

IS_SCRIPTS = [rloo_vllm, ppo_vllm, grpo_vllm]


@pytest.mark.parametrize("script", IS_SCRIPTS, ids=lambda s: s.__name__)
def test_mask_mode_keeps_a_weight_exactly_at_the_cap(script):
    """A ratio of exactly 1 (log-ratio 0) at --is-cap 1 is not above it: kept, and not counted as truncated; a ratio
    of 1.5 is masked. By token (where a level has it) and by response."""
    proximal = torch.tensor([[0.0, math.log(1.5)], [0.0, 0.0]])
    behaviour, mask = torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool)
    if script is not rloo_vllm:
        weights, stats = script.importance_weights(proximal, behaviour, mask, 1.0, "token", "mask")
        assert weights.tolist() == [[1.0, 0.0], [1.0, 1.0]]
        assert stats["async/is_truncated"] == 0.25
    weights, stats = script.importance_weights(proximal, behaviour, mask, 1.0, "sequence", "mask")
    assert weights.tolist() == [0.0, 1.0] and stats["async/is_truncated"] == 0.5
    weights, _ = script.importance_weights(behaviour, behaviour, mask, 1.0, "geometric", "mask")
    assert weights.tolist() == [1.0, 1.0]


def loop_statements(script, call, names):
    """main's statement that calls `call`, and the ones right after it that assign to one of `names`: a module."""
    main = definitions(script)["main"][0]
    for node in ast.walk(main):
        body = getattr(node, "body", None)
        for i, statement in enumerate(body if isinstance(body, list) else []):
            if isinstance(statement, ast.Assign) and calls_in(statement.value, call):
                taken = [statement]
                for following in body[i + 1:]:
                    if not (isinstance(following, ast.Assign) and {ast.unparse(t) for t in following.targets} & names):
                        break
                    taken.append(following)
                return ast.Module(body=taken, type_ignores=[])
    raise AssertionError(f"{script}'s main does not call {call}")


# Two responses of up to three tokens; token ratios pi_prox / pi_behaviour of 3 and 1/2 then padding (a log-probability
# of 9 there, which must count for nothing), and of 1.5, 1.5, 1.5. By hand, at --is-cap 2: per token, [2, 0.5] and
# [1.5] x 3 (mask: [0, 0.5]); per response, the products 1.5 and 3.375 (truncate: 2; mask: 0); geometric, sqrt(1.5)
# and 1.5. A response's weight goes on each of its tokens (ppo_vllm, grpo_vllm), padding included (the mask drops it).
LEARNER = torch.tensor([[math.log(3), -math.log(2), 9.0], [math.log(1.5)] * 3])
PADDING = torch.tensor([[False, False, True], [False, False, False]])
IS_CASES = [  # --is-cap, --is-level, --is-mode: per response, per token (padding: 1 if per token)
    ("2", "token", "truncate", [[2.0, 0.5, 1.0], [1.5, 1.5, 1.5]]),
    ("2", "token", "mask", [[0.0, 0.5, 1.0], [1.5, 1.5, 1.5]]),
    ("2", "sequence", "truncate", [[1.5] * 3, [2.0] * 3]),
    ("2", "sequence", "mask", [[1.5] * 3, [0.0] * 3]),
    ("2", "geometric", "truncate", [[math.sqrt(1.5)] * 3, [1.5] * 3]),
    ("1.3", "geometric", "mask", [[math.sqrt(1.5)] * 3, [0.0] * 3]),
    ("4", "sequence", "truncate", [[1.5] * 3, [3.375] * 3]),
    ("0", "sequence", "mask", [[1.0] * 3, [1.0] * 3]),
]


def typing_choices(script, field):
    return typing.get_args(script.Args.__dataclass_fields__[field].type)


IS_RUNS = [(script, *case) for script in IS_SCRIPTS for case in IS_CASES
           if case[1] in typing_choices(script, "is_level")]  # each script's own levels


@pytest.mark.parametrize("script, cap, level, mode, expected", IS_RUNS,
                         ids=[f"{s.__name__}-{c}-{l}-{m}" for s, c, l, m, _ in IS_RUNS])
def test_the_loop_weights_by_the_is_options_given_on_the_command_line(script, cap, level, mode, expected, monkeypatch):
    """--is-cap, --is-level and --is-mode parsed as a user gives them, then main's own statements that make the
    importance weights run on hand-made log-probabilities; and main passes the weights to its loss."""
    name = script.__name__ + ".py"
    monkeypatch.setattr(sys, "argv", [name, "--is-cap", cap, "--is-level", level, "--is-mode", mode])
    args = script.parse_arguments(script.Args)
    namespace = {**vars(script), "args": args, "logprobs": LEARNER.masked_fill(PADDING, 9.0),
                 "behaviour_logprobs": torch.zeros(2, 3), "padding_mask": PADDING}
    exec(compile(loop_statements(name, "importance_weights", {"is_weights", "is_stats"}), name, "exec"), namespace)
    weights = namespace["is_weights"]
    if script is rloo_vllm:  # one weight per response
        expected = [row[0] for row in expected]
    assert torch.allclose(weights, torch.tensor(expected)), (cap, level, mode, weights.tolist())
    losses = [call for call in ast.walk(definitions(name)["main"][0]) if isinstance(call, ast.Call)
              and getattr(call.func, "id", "").endswith("_policy_loss")]
    assert losses and all(ast.unparse(call.args[-1]) == "is_weights[idx]" for call in losses), \
        f"{name}'s loss is not given the weights: {[ast.unparse(call) for call in losses]}"


@pytest.mark.parametrize("script", ALGORITHMS)
def test_every_loop_stops_a_diverged_model_after_its_updates_and_before_it_is_used(script):
    """rloo.py's run that diverges is in test_scripts_run.py; every script's loop calls the same check once, on every
    engine it steps (PPO's value model too) and saves, after the last step and before the weights go to vLLM, are
    evaluated or saved."""
    loop = update_loop(script)
    (check,) = calls_in(loop, "stop_if_diverged")
    checked = {ast.unparse(value) for value in check.args[0].values}
    steps = [call for call in calls_in(loop, "step") if isinstance(call.func, ast.Attribute)]
    stepped = {ast.unparse(call.func.value) for call in steps}
    saved = {ast.unparse(value) for call in calls_in(loop, "save_checkpoint") for value in call.args[4].values}
    assert stepped and checked == stepped == saved, (checked, stepped, saved)
    last_step = max(call.lineno for call in steps)
    uses = [call.lineno for name in ("hand_over", "evaluate", "save_checkpoint") for call in calls_in(loop, name)
            if call.lineno > last_step]
    assert uses and last_step < check.lineno < min(uses), (last_step, check.lineno, uses)


# ---------------------------------------------------------------------------------------------------------------------
# M8. A *_vllm.py's LoRA lines (the adapter, the reference as the policy with it off, what is saved) are those of its HF
# sibling, in order: test_lora.py runs every HF script with an adapter, and of the *_vllm.py rloo_vllm.py and
# ppo_vllm.py (the adapter's hand-off to vLLM and its check are AsyncGeneration's, one code for every *_vllm.py).

def lora_lines(script):
    with open(script) as f:
        return [line.strip() for line in f if re.search(r"lora|ref_policy|reference_model\(", line)
                and not line.startswith(("import ", "from "))]


@pytest.mark.parametrize("script", [s for s in SHIPPED_ALGORITHMS if s.endswith("_vllm.py")])
def test_each_vllm_scripts_lora_lines_are_its_hf_siblings(script):
    sibling = script.replace("_vllm", "")
    assert lora_lines(script) and lora_lines(script) == lora_lines(sibling), \
        f"{script}'s LoRA lines differ from {sibling}'s: change them together, or run {script} with an adapter in " \
        "test_lora.py's every-script test"
