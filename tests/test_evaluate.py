"""evaluate.py on the tiny task: gold win rate and KL of a run's checkpoints, with both backends."""

import json
import os

import pytest
import torch
from conftest import TINY, assert_bad_input, assert_bad_input_result, bad_path, forked_runs, run_dir_of, run_script
from transformers import AutoModelForSequenceClassification, AutoTokenizer

pytestmark = pytest.mark.slow  # runs scripts or vLLM engines: minutes


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """50 updates of online DPO (lr 1e-4), checkpoints at updates 25 and 50."""
    out = tmp_path_factory.mktemp("runs")
    run_script("online_dpo.py", "--learning-rate", "1e-4", "--total-episodes", "3200", "--save-every", "25",
               "--eval-every", "0", "--output-dir", str(out))
    return run_dir_of(out)


def _evaluate(*arguments):
    run_script("evaluate.py", "--num-eval-prompts", "256", *arguments)


def test_win_rate_and_kl_of_every_checkpoint_with_both_backends(trained_run, tmp_path):
    _evaluate("--checkpoints", os.path.join(TINY, "sft"), "--backend", "hf", "--output", str(tmp_path / "sft.json"))
    _evaluate("--checkpoints", trained_run, "--backend", "hf", "--output", str(tmp_path / "hf.json"))
    _evaluate("--checkpoints", trained_run, "--backend", "vllm", "--vllm-enforce-eager")  # default output
    sft = json.loads((tmp_path / "sft.json").read_text())
    hf = json.loads((tmp_path / "hf.json").read_text())
    with open(os.path.join(trained_run, "evaluation.json")) as f:
        vllm = json.load(f)

    (sft_metrics,) = sft["checkpoints"].values()
    assert sft_metrics["kl"] == 0.0  # the SFT model against itself: identical log-probabilities
    assert 0.1 < sft_metrics["win_rate"] < 0.4  # measured 0.24 on all 2000 test prompts: one-word answers
    assert sft["reference_gold_score"] == pytest.approx(0.37, abs=0.05)  # the references' mean gold (build stats)

    for results in (hf, vllm):
        assert [c["update"] for c in results["checkpoints"].values()] == [25, 50]
        first, last = results["checkpoints"].values()
        # Training moves the policy away from the SFT model and past the references.
        assert 0 < first["kl"] < last["kl"]
        assert last["win_rate"] > sft_metrics["win_rate"] + 0.2  # measured 0.26 -> 0.57 on 256 prompts
        assert last["perplexity"] > sft_metrics["perplexity"] >= 1.0
    # Near-greedy responses (temperature 0.01) are the same whichever engine generates them.
    for a, b in zip(hf["checkpoints"].values(), vllm["checkpoints"].values()):
        assert b["win_rate"] == pytest.approx(a["win_rate"], abs=0.02)
        assert b["gold_score"] == pytest.approx(a["gold_score"], abs=0.01)
        assert b["response_length"] == pytest.approx(a["response_length"], abs=0.05)


BAD_INPUT = [
    ([], "--checkpoints"),
    (["--checkpoints", "/nonexistent/run"], "--checkpoints"),
    (["--checkpoints", "assets/tiny/sft", "--backend", "tpu"], "--backend"),
    (["--checkpoints", "assets/tiny/sft", "--temperature", "-1"], "--temperature"),
    (["--checkpoints", "assets/tiny/sft", "--gold-reward-model-path", "None"], "--gold-reward-model-path"),
    (["--checkpoints", "assets/tiny/sft", "--reference-column", "summary"], "--reference-column"),
    (["--checkpoints", "assets/tiny/sft", "--dataset-name", "assets/tiny/chat_data", "--dataset-eval-split", "train"],
     "--reference-column"),  # chats without a final reply, and no reference column
    (["--checkpoints", "assets/tiny/sft", "--gold-reward-model-path", "assets/tiny/sft"], "--gold-reward-model-path"),
    (["--checkpoints", "assets/tiny/sft", "--temperature", "nan"], "--temperature"),
    (["--checkpoints", "assets/tiny/sft", "--seed", "-1"], "--seed"),
    (["--checkpoints", "assets/tiny/sft", "--output", "assets/tiny"], "--output"),  # a directory
    (["--checkpoints", "assets/tiny/sft", "--output", "/nonexistent/evaluation.json"], "--output"),
    (["--checkpoints", "assets/tiny/reward"], "--checkpoints"),  # a reward model, not a policy
    (["--checkpoints", "CORRUPT_CONFIG"], "--checkpoints"),
    (["--checkpoints", "NO_TOKENIZER"], "--checkpoints"),
    (["--checkpoints", "A_FILE"], "--checkpoints"),
    (["--checkpoints", "assets/tiny/sft", "--dataset-name", "NUMBER_QUERY"], "--dataset-name"),
    (["--checkpoints", "assets/tiny/sft", "--dataset-name", "STRING_MESSAGES"], "--dataset-name"),
]


@pytest.fixture(scope="module")
def bad_input_runs(tmp_path_factory):
    """BAD_INPUT's cases forked from one process that imported the libraries once (forked_runs), each with its own
    temporary directory for its bad paths."""
    cases = [[bad_path(tmp_path_factory.mktemp(f"case{i}"), a) if a.isupper() else a for a in arguments]
             for i, (arguments, _) in enumerate(BAD_INPUT)]
    return forked_runs("evaluate.py", cases, tmp_path_factory.mktemp("forked") / "runs.json")


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[" ".join(a) for a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_naming_the_argument(bad_input_runs, case):
    """Found before any model loads (a bad --output, say, not after the whole evaluation)."""
    returncode, _, stderr, seconds = bad_input_runs[case]
    assert_bad_input_result(returncode, stderr, seconds, BAD_INPUT[case][1])


def test_bad_input_in_a_process_of_its_own_as_a_user_runs_it():
    assert_bad_input("evaluate.py", ["--checkpoints", "/nonexistent/run"], "--checkpoints")


def test_the_output_directory_instead_of_a_run_names_the_run_to_pass(trained_run):
    """`--checkpoints runs` (the --output-dir) instead of `runs/<run name>`: exit 2, and the line names the run."""
    result = run_script("evaluate.py", "--checkpoints", os.path.dirname(trained_run), check=False)
    assert_bad_input_result(result.returncode, result.stderr, 0, "--checkpoints")
    assert f"pass one, e.g. {trained_run})" in result.stderr


def _gold_model_with_another_tokenizer(path):
    """The tiny gold reward model under a tokenizer that numbers every ordinary token differently (in reverse)
    and has no pad token (like the paper's gold model, whose tokenizer lacks the SFT model's): the same
    model of the same texts, which only scoring re-tokenised text can read."""
    gold = os.path.join(TINY, "gold_reward")
    with open(os.path.join(gold, "tokenizer.json")) as f:
        spec = json.load(f)
    vocab = spec["model"]["vocab"]
    new_id = {old: (old if old < 2 else len(vocab) + 1 - old) for old in vocab.values()}  # 0, 1: EOS and padding
    spec["model"]["vocab"] = {token: new_id[old] for token, old in vocab.items()}
    model = AutoModelForSequenceClassification.from_pretrained(gold)
    weight = model.get_input_embeddings().weight
    with torch.no_grad():
        weight[list(new_id.values())] = weight[list(new_id.keys())].clone()
    model.config.pad_token_id = None
    model.save_pretrained(path)
    with open(os.path.join(path, "tokenizer.json"), "w") as f:
        json.dump(spec, f)
    with open(os.path.join(gold, "tokenizer_config.json")) as f:
        config = {k: v for k, v in json.load(f).items() if k != "pad_token"}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.pad_token is None and tokenizer.encode(" beach") != AutoTokenizer.from_pretrained(gold).encode(" beach")


def test_a_gold_model_with_another_tokenizer_scores_the_text(tmp_path):
    other = str(tmp_path / "other_gold")
    _gold_model_with_another_tokenizer(other)
    common = ["--checkpoints", os.path.join(TINY, "sft"), "--backend", "hf", "--num-eval-prompts", "64"]
    run_script("evaluate.py", *common, "--output", str(tmp_path / "same.json"))
    result = run_script("evaluate.py", *common, "--gold-reward-model-path", other, "--output", str(tmp_path / "other.json"))
    assert "the gold model scores the text in its own tokens" in result.stdout
    same, other = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("same", "other"))
    # The same texts and weights: equal up to float summation (2e-5 seen within a full test run; scoring the
    # policy's token ids with the other vocabulary would be off by tenths).
    assert other["reference_gold_score"] == pytest.approx(same["reference_gold_score"], abs=1e-4)
    (a,), (b,) = same["checkpoints"].values(), other["checkpoints"].values()
    for key in ("gold_score", "gold_margin"):
        assert b[key] == pytest.approx(a[key], abs=1e-4), key
    # A response whose text equals its reference scores the same up to the last bits of a float, which the
    # padding of the batch moves; the paper's strict "better than" turns such a tie either way (1 of 64 here).
    assert b["win_rate"] == pytest.approx(a["win_rate"], abs=2 / 64)
