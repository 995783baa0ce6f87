"""Verifiable rewards and chat data: the rule reward by hand, chat prompts rendered with the tokenizer's
template, the math task's assets, and RLOO and online DPO learning the math task (issue: the paper's
GSM8K and chatbot experiments in miniature)."""

import json
import os
import shutil
import types

import pytest
import torch
from conftest import ROOT, TINY, assert_finite, read_metrics, run_dir_of, run_script
from transformers import AutoTokenizer

import data
import rloo

MATH = os.path.join(ROOT, "assets", "tiny_math")


@pytest.mark.parametrize("response, answer, reward", [
    (" 55", "55", 1.0),
    (" 47 + 8 = 55", "55", 1.0),              # the last number counts
    (" 55 apples, not 45", "55", 0.0),
    (" 45", "55", 0.0),
    (" no number", "55", 0.0),
    (" The answer is 1,234.", "1234", 1.0),  # commas inside numbers are ignored, a full stop ends one
    (" -3", "-3", 1.0),
    (" 3", "-3", 0.0),
    (" 2.50", "2.5", 1.0),
    (" 72", "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72 clips.\n#### 72", 1.0),  # GSM8K's answer column
    (" 24", "Natalia sold 48/2 = 24 clips in May.\n48+24 = 72 clips.\n#### 72", 0.0),
    (" 5", "", 0.0),
])
def test_last_number_reward_by_hand(response, answer, reward):
    assert rloo.last_number_reward(response, answer) == reward


def test_rule_scores_read_the_decoded_response_and_the_prompts_answer():
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(MATH, "sft"))
    query = tokenizer.encode("Question: Ann has 47 apples. She buys 8 more. How many apples does Ann have now?\nAnswer:")
    responses = [" 55", " 45", " 5 5", " 555"]
    rows = [query + tokenizer.encode(r) + [tokenizer.eos_token_id] for r in responses]
    width = max(len(r) for r in rows)
    query_responses = torch.tensor([r + [tokenizer.pad_token_id] * (width - len(r)) for r in rows])
    args = types.SimpleNamespace(rule_reward="last_number")
    scores = rloo.score_responses(args, None, query_responses, len(query), ["55"] * 4, tokenizer)
    assert scores.tolist() == [1.0, 0.0, 0.0, 0.0]  # " 5 5" is two numbers, the last is 5


def _prompt_args(dataset, rule_reward=None):
    return types.SimpleNamespace(dataset_name=str(dataset), dataset_train_split="train", dataset_eval_split="test",
                                 max_prompt_length=64, rule_reward=rule_reward, answer_column="answer",
                                 sft_model_path=os.path.join(TINY, "sft"))


def test_chat_prompts_are_rendered_with_the_chat_template_and_query_prompts_are_unchanged(tmp_path):
    tokenizer = data.load_tokenizer(os.path.join(TINY, "sft"), False)
    with open(os.path.join(TINY, "data", "test.jsonl")) as f:
        queries = [json.loads(line)["query"] for line in f][:8]
    chat = tmp_path / "chat"
    chat.mkdir()
    for split in ("train", "test"):
        with open(chat / f"{split}.jsonl", "w") as f:
            for i, query in enumerate(queries):
                messages = [{"role": "user", "content": query}]
                if i % 2:  # a conversation that ends in its reference reply (as No Robots'): the reply is dropped
                    messages.append({"role": "assistant", "content": "food"})
                f.write(json.dumps({"messages": messages}) + "\n")
    train, test, train_answers, _ = data.load_prompts(_prompt_args(chat), tokenizer)
    assert train == test and train_answers == [None] * 8
    assert [tokenizer.decode(ids) for ids in test] == [f"USER: {query}\nASSISTANT:" for query in queries]
    _, plain, _, _ = data.load_prompts(_prompt_args(os.path.join(TINY, "data")), tokenizer)
    assert plain[:8] == [tokenizer.encode(q, add_special_tokens=False)[-64:] for q in queries]
    _, shipped, _, _ = data.load_prompts(_prompt_args(os.path.join(TINY, "chat_data")), tokenizer)
    assert len(shipped) == 200 and [tokenizer.decode(ids) for ids in shipped[:8]] == [
        f"USER: {query}\nASSISTANT:" for query in queries]


def test_math_task_assets_have_disjoint_splits_answers_and_headroom():
    splits = {}
    for split in ("train", "test"):
        with open(os.path.join(MATH, "data", f"{split}.jsonl")) as f:
            splits[split] = [json.loads(line) for line in f]
    test_operations = {p["operation"] for p in splits["test"]}
    assert not test_operations & {p["operation"] for p in splits["train"]}
    for p in splits["test"]:
        a, op, b = p["operation"].split()
        assert int(p["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert p["query"].endswith("\nAnswer:")
    with open(os.path.join(MATH, "build_stats.json")) as f:
        stats = json.load(f)
    assert 0.3 <= stats["sft_greedy_accuracy"] <= 0.5  # headroom for RL
    assert stats["sft_sampled_accuracy_carry"] > stats["sft_greedy_accuracy_carry"]  # which RL can find


@pytest.mark.slow
def test_quick_rebuild_of_the_math_task(tmp_path):
    result = run_script("assets/make_tiny_math.py", "--quick", timeout=900)
    out = result.stdout.strip().splitlines()[-1].split()[-1]
    try:
        assert sorted(os.listdir(out)) == ["README.md", "build_stats.json", "data", "sft"]
        with open(os.path.join(out, "data", "test.jsonl")) as f, open(os.path.join(MATH, "data", "test.jsonl")) as g:
            assert f.read() == g.read()  # the problems depend on the seed only
    finally:
        import shutil

        shutil.rmtree(out, ignore_errors=True)


MATH_ARGS = ["--sft-model-path", "assets/tiny_math/sft", "--dataset-name", "assets/tiny_math/data", "--rule-reward",
             "last_number", "--response-length", "8", "--max-prompt-length", "48", "--learning-rate", "3e-4",
             "--num-eval-prompts", "288"]


def _math_run(script, updates, out, *extra):
    """`updates` updates of 64 responses on the math task; greedy test accuracy (eval/scores) at 0 and four times."""
    run_script(script, *MATH_ARGS, "--total-episodes", str(64 * updates), "--eval-every", str(updates // 4),
               "--output-dir", str(out), *extra, timeout=900)
    return run_dir_of(out)


@pytest.fixture(scope="module")
def rloo_math_run(tmp_path_factory):
    return _math_run("rloo.py", 100, tmp_path_factory.mktemp("rloo_math"))


@pytest.mark.slow
# RLOO (whose run evaluate.py reads back below) and GRPO asynchronously as DAPO, whose filter of all-equal groups acts
# here: about 60 % of the groups score all 0 or all 1. The other scripts share the rule reward and its scoring
# (identical in every script: tests/test_layout.py) and are left out of CI, which keeps under 50 minutes; measured to
# gain 27-33 points (docs/math.md): grpo.py 0.486 -> 0.715 (--loss-type dapo 0.708), grpo_vllm.py 0.733, as DAPO
# 0.736 (with GRPO's beta 0.04, before DAPO's defaults, which the test runs now); online_dpo.py and bok.py in 200
# updates.
@pytest.mark.parametrize("command, updates", [
    (["rloo.py"], 100),
    (["grpo_vllm.py", "--loss-type", "dapo", "--vllm-enforce-eager"], 100)],
    ids=lambda x: " ".join(x) if isinstance(x, list) else str(x))
def test_rl_raises_greedy_test_accuracy_on_the_math_task_by_20_points(request, tmp_path, command, updates):
    script = command[0]
    run_dir = (request.getfixturevalue("rloo_math_run") if script == "rloo.py"
               else _math_run(script, updates, tmp_path, *command[1:]))
    curve = [round(row["eval/scores"], 3) for row in read_metrics(run_dir) if "eval/scores" in row]
    assert len(curve) == 5 and curve[-1] - curve[0] >= 0.2, curve  # from the SFT policy (update 0)


@pytest.mark.slow
def test_evaluate_reports_the_accuracy_the_run_logged(rloo_math_run):
    run_script("evaluate.py", "--checkpoints", rloo_math_run, "--backend", "hf", "--temperature", "0",
               *MATH_ARGS[:10])
    with open(os.path.join(rloo_math_run, "evaluation.json")) as f:
        (result,) = json.load(f)["checkpoints"].values()
    logged = read_metrics(rloo_math_run)[-1]["eval/scores"]
    # The same greedy decoding of the same 288 prompts, batched differently: at most a tie flips.
    assert result["update"] == 100 and abs(result["accuracy"] - logged) <= 2 / 288, (result, logged)
    assert set(result) == {"update", "accuracy", "kl", "perplexity", "response_length"}


@pytest.mark.slow
def test_ppo_learns_without_a_reward_model(tmp_path):
    run_dir = _math_run("ppo.py", 40, tmp_path / "ppo")
    rows = read_metrics(run_dir)
    assert_finite(rows)
    # The value model's new head is zeros: every first value is 0, no better or worse than a constant.
    assert rows[1]["val/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    curve = [round(row["eval/scores"], 3) for row in rows if "eval/scores" in row]
    assert curve[-1] - curve[0] >= 0.1, curve  # 0.486 -> 0.743 when measured (0.684 with a random head)


@pytest.mark.slow
def test_ppo_vllm_starts_its_value_head_at_zeros_without_a_reward_model(tmp_path):
    """ppo_vllm.py's own copy of the value model's set-up (its main block): every first value is 0 there too."""
    run_script("ppo_vllm.py", *MATH_ARGS, "--sync", "--vllm-enforce-eager", "--total-episodes", "128",
               "--eval-every", "0", "--output-dir", str(tmp_path))
    rows = read_metrics(run_dir_of(tmp_path))
    assert_finite(rows)
    assert len(rows) == 3 and rows[1]["val/explained_variance"] == pytest.approx(0.0, abs=1e-6)
    assert rows[2]["val/explained_variance"] != pytest.approx(0.0, abs=1e-6)  # the head has learnt since


@pytest.mark.slow
def test_a_chat_dataset_trains_exactly_as_the_same_prompts_as_plain_queries(tmp_path):
    """rloo.py on assets/tiny/chat_data under a chat template that renders a chat as its user turn, and on the
    same texts as a `query` dataset: the same numbers, update by update (the tiny SFT model, trained on plain
    queries, cannot read the shipped template's USER:/ASSISTANT: words, so it could not learn from those)."""
    sft = tmp_path / "sft"
    shutil.copytree(os.path.join(TINY, "sft"), sft)
    (sft / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    plain = tmp_path / "plain"
    plain.mkdir()
    for split in ("train", "test"):
        with open(os.path.join(TINY, "chat_data", f"{split}.jsonl")) as f, open(plain / f"{split}.jsonl", "w") as g:
            for line in f:
                g.write(json.dumps({"query": json.loads(line)["messages"][0]["content"]}) + "\n")
    runs = {}
    for name in ("chat", "plain"):
        data = os.path.join(TINY, "chat_data") if name == "chat" else str(plain)
        run_script("rloo.py", "--sft-model-path", str(sft), "--dataset-name", data, "--total-episodes", "640",
                   "--eval-every", "5", "--num-eval-prompts", "64", "--output-dir", str(tmp_path / name))
        runs[name] = read_metrics(run_dir_of(tmp_path / name))
    assert [row["update"] for row in runs["chat"]] == [row["update"] for row in runs["plain"]] == list(range(11))
    assert_finite(runs["chat"])
    # Each figure at every update it is due (the training ones at updates 1-10, evaluation's at 0, 5 and 10), in both
    # runs: a figure that either run fails to log fails here (row[key]), rather than being compared nowhere.
    due = {"objective/scores": range(1, 11), "objective/kl": range(1, 11), "loss/policy_avg": range(1, 11),
           "eval/scores": [0, 5, 10], "eval/gold_scores": [0, 5, 10]}
    for key, updates in due.items():
        chat, query = ([row[key] for row in runs[name] if row["update"] in updates] for name in ("chat", "plain"))
        assert len(chat) == len(query) == len(updates), key
        assert chat == pytest.approx(query, rel=1e-5, abs=1e-6), key
    assert runs["chat"][-1]["objective/kl"] > 0  # it trained


def test_async_benchmark_averages_seeds_and_times_the_first_evaluation_at_the_sync_runs_final_accuracy():
    import importlib.util

    spec = importlib.util.spec_from_file_location("async_speedup", os.path.join(ROOT, "benchmark", "async_speedup.py"))
    async_speedup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(async_speedup)
    curve = [(0.0, 0.486), (10.0, 0.6), (20.0, 0.75), (30.0, 0.74), (40.0, 0.77)]
    assert async_speedup.first_time_at(curve, 0.74) == 20.0
    assert async_speedup.first_time_at(curve, 0.6) == 10.0  # equal counts as reached
    assert async_speedup.first_time_at(curve, 0.8) is None
    seeds = [{"accuracy": 0.7, "curve": [(0.0, 0.5), (10.0, 0.7)]}, {"accuracy": 0.8, "curve": [(0.0, 0.5), (12.0, 0.8)]}]
    assert async_speedup.mean_of(seeds) == {"accuracy": 0.75, "curve": [(0.0, 0.5), (11.0, 0.75)]}


def test_evaluate_reads_chat_data_as_the_scripts_do_with_the_final_reply_as_reference():
    import evaluate

    tokenizer = data.load_tokenizer(os.path.join(TINY, "sft"), False)
    stop = tokenizer.eos_token_id
    args = types.SimpleNamespace(dataset_name=os.path.join(TINY, "chat_data"), dataset_eval_split="test",
                                 rule_reward=None, answer_column="answer", reference_column="reference_response",
                                 num_eval_prompts=16, max_prompt_length=64, response_length=16,
                                 sft_model_path=os.path.join(TINY, "sft"))
    prompts, references = evaluate.load_eval_data(args, tokenizer, stop)
    _, scripts_prompts, _, _ = data.load_prompts(_prompt_args(os.path.join(TINY, "chat_data")), tokenizer)
    assert prompts == scripts_prompts[:16]
    with open(os.path.join(TINY, "chat_data", "test.jsonl")) as f:
        replies = [json.loads(line)["messages"][-1]["content"] for line in f][:16]
    assert references == [tokenizer.encode(reply, add_special_tokens=False) + [stop] for reply in replies]
