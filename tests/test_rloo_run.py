"""rloo.py run as a user runs it: defaults, learning, resume, DeepSpeed, bad input, other models."""

import glob
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from conftest import (ROOT, TINY, algorithm_metrics, assert_finite, read_metrics, run, run_dir_of,
                      run_script)
from transformers import AutoModelForCausalLM, AutoTokenizer

DESIGN_METRICS = [
    "objective/scores", "objective/kl", "objective/non_score_reward", "objective/rlhf_reward", "objective/entropy",
    "loss/policy_avg", "policy/approxkl_avg", "policy/clipfrac_avg", "val/ratio", "val/num_eos_tokens", "lr",
    "episode", "eps", "time/generation", "time/training",
]
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def test_help_lists_every_argument_with_its_docstring():
    import rloo

    for command in ([sys.executable, "rloo.py", "--help"], [DEEPSPEED, "--num_accelerators", "1", "rloo.py", "--help"]):
        text = " ".join(re.sub("[│╭╮╰╯─]", " ", run(command, env={"COLUMNS": "300"}).stdout).split())
        for field in rloo.Args.__dataclass_fields__:
            assert f"--{field.replace('_', '-')}" in text, field
        assert "responses sampled per prompt" in text and "(the off-policy knob)" in text


def test_default_run_logs_finite_metrics_and_saves_a_loadable_checkpoint(tmp_path):
    out = tmp_path / "runs"
    run_script("rloo.py", "--total-episodes", "256", "--eval-every", "2", "--track", "--output-dir", str(out),
               env={"WANDB_DIR": str(tmp_path)})
    run_dir = run_dir_of(out)
    (wandb_run,) = glob.glob(str(tmp_path / "wandb" / "offline-run-*"))  # --track logged to wandb (offline)
    assert glob.glob(os.path.join(wandb_run, "*.wandb"))
    rows = read_metrics(run_dir)
    assert [row["update"] for row in rows] == [0, 1, 2, 3, 4]
    assert_finite(rows)
    for key in DESIGN_METRICS + ["eval/scores", "eval/gold_scores"]:
        assert key in rows[2], key
    first = rows[1]
    assert first["episode"] == 64 and rows[-1]["episode"] == 256
    assert abs(first["objective/kl"]) < 1e-6  # before the first update the policy is the reference
    assert abs(first["val/ratio"] - 1) < 1e-5  # one update per batch: the ratio is exactly one
    assert first["objective/rlhf_reward"] == pytest.approx(first["objective/scores"] + first["objective/non_score_reward"])

    checkpoint = os.path.join(run_dir, "checkpoint-4")
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    sft = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    moved = max((p - q).abs().max().item() for p, q in zip(model.parameters(), sft.parameters()))
    assert moved > 1e-5  # the saved weights are the trained ones (Adam moves each weight by about lr per step)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    assert len(tokenizer) == model.config.vocab_size


def test_learning_raises_proxy_and_gold_scores_on_held_out_prompts(tmp_path):
    """About 80 seconds of RLOO on the tiny task with the default settings but 400 updates (the
    learning rate decays to zero over the run). Measured: the proxy score of greedy answers to
    held-out prompts rose from -0.42 to 2.95 and the gold score from 0.20 to 0.82. A proxy that
    rose while gold fell would be reward hacking, not learning."""
    run_script("rloo.py", "--total-episodes", "25600", "--eval-every", "100", "--output-dir", str(tmp_path))
    evals = [row for row in read_metrics(run_dir_of(tmp_path)) if "eval/scores" in row]
    first, last = evals[0], evals[-1]
    assert first["episode"] == 0 and last["episode"] == 25600
    assert last["eval/scores"] - first["eval/scores"] > 1.0, evals
    assert last["eval/gold_scores"] - first["eval/gold_scores"] > 0.2, evals
    assert last["eval/response_length"] > first["eval/response_length"]  # it learned to name more topic words


def test_resume_after_a_kill_reproduces_the_uninterrupted_run(tmp_path):
    common = ["--total-episodes", "384", "--eval-every", "2", "--save-every", "2"]
    run_script("rloo.py", *common, "--output-dir", str(tmp_path / "whole"))
    whole = read_metrics(run_dir_of(tmp_path / "whole"))

    # Kill a second run as soon as its first checkpoint is complete, then resume it.
    out = tmp_path / "killed"
    env = {**os.environ, "WANDB_MODE": "offline"}
    process = subprocess.Popen([sys.executable, "rloo.py", *common, "--output-dir", str(out)], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 300
    while not any(os.path.isdir(os.path.join(d, "checkpoint-2")) for d in out.glob("*__*")):
        assert process.poll() is None and time.time() < deadline, "the run ended before its first checkpoint"
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    run_dir = run_dir_of(out)
    run_script("rloo.py", *common, "--output-dir", str(out), "--resume", run_dir)
    resumed = read_metrics(run_dir)
    assert [row["update"] for row in resumed] == list(range(7))
    expected, got = algorithm_metrics(whole), algorithm_metrics(resumed)
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)


@pytest.mark.parametrize("stage", [2, 3])
def test_two_process_deepspeed_matches_across_zero_stages(tmp_path, stage):
    out = tmp_path / f"zero{stage}"
    run([DEEPSPEED, "--num_accelerators", "2", "rloo.py", "--deepspeed-config", f"ds_configs/zero{stage}.json",
         "--per-device-train-batch-size", "32", "--total-episodes", "192", "--output-dir", str(out)])
    rows = read_metrics(run_dir_of(out))
    assert_finite(rows)
    assert [row["update"] for row in rows] == [0, 1, 2, 3] and rows[-1]["episode"] == 192
    assert abs(rows[1]["objective/kl"]) < 1e-6
    # Both stages start from the same weights and seeds: the first generation batch is identical.
    reference = _reference_first_update(tmp_path)
    assert rows[1]["objective/scores"] == pytest.approx(reference["objective/scores"], abs=1e-5)
    assert rows[0]["eval/scores"] == pytest.approx(reference["eval/scores"], abs=1e-5)
    # The checkpoint holds full, trained weights (ZeRO-3 gathers its shards to save them).
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir_of(out), "checkpoint-3"))
    sft = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    assert all(p.shape == q.shape for p, q in zip(model.parameters(), sft.parameters()))
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), sft.parameters())) > 1e-5  # ~2 x lr


_first_update = {}


def _reference_first_update(tmp_path):
    """Update 0 and 1 metrics of a 2-process ZeRO-2 run (computed once per session)."""
    if not _first_update:
        out = tmp_path / "reference"
        run([DEEPSPEED, "--num_accelerators", "2", "rloo.py", "--per-device-train-batch-size", "32",
             "--total-episodes", "64", "--output-dir", str(out)])
        rows = read_metrics(run_dir_of(out))
        _first_update.update(rows[0], **{k: v for k, v in rows[1].items() if k.startswith("objective/")})
    return _first_update


def _dataset_without_query_column(tmp_path):
    path = tmp_path / "bad_dataset"
    path.mkdir()
    for split in ("train", "test"):
        (path / f"{split}.jsonl").write_text('{"prompt": "hello"}\n')
    return str(path)


@pytest.mark.parametrize("arguments, argument", [
    (["--k", "1"], "--k"),
    (["--per-device-train-batch-size", "63"], "--k"),
    (["--total-episodes", "10"], "--total-episodes"),
    (["--response-length", "100"], "--response-length"),
    (["--temperature", "0"], "--temperature"),
    (["--sft-model-path", "assets/tiny/missing"], "--sft-model-path"),
    (["--reward-model-path", "/nonexistent/reward"], "--reward-model-path"),
    (["--deepspeed-config", "ds_configs/missing.json"], "--deepspeed-config"),
    (["--dataset-name", "assets/tiny/missing"], "--dataset-name"),
    (["--dataset-name", "BAD_DATASET"], "--dataset-name"),
    (["--dataset-eval-split", "validation"], "--dataset-eval-split"),
    (["--stop-token", "no such token"], "--stop-token"),
    (["--resume", "/nonexistent/run"], "--resume"),
])
def test_bad_input_exits_2_with_one_line_naming_the_argument(tmp_path, arguments, argument):
    arguments = [_dataset_without_query_column(tmp_path) if a == "BAD_DATASET" else a for a in arguments]
    started = time.time()
    result = run_script("rloo.py", *arguments, "--output-dir", str(tmp_path), check=False)
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {argument}:"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert not os.listdir(tmp_path) or os.listdir(tmp_path) == ["bad_dataset"]  # nothing was run
    assert time.time() - started < 60


def test_random_tiny_llama_works_as_policy_and_reward_model(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "sft"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                         bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    for name, cls in (("policy", LlamaForCausalLM), ("reward", LlamaForSequenceClassification)):
        cls(config).save_pretrained(tmp_path / name)
        tokenizer.save_pretrained(tmp_path / name)
    out = tmp_path / "runs"
    run_script("rloo.py", "--sft-model-path", str(tmp_path / "policy"), "--reward-model-path",
               str(tmp_path / "reward"), "--gold-reward-model-path", "None", "--total-episodes", "128",
               "--output-dir", str(out))
    rows = read_metrics(run_dir_of(out))
    assert_finite(rows)
    assert abs(rows[1]["objective/kl"]) < 1e-6 and rows[2]["objective/kl"] != 0.0
    model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir_of(out), "checkpoint-2"))
    assert model.config.model_type == "llama"
    initial = LlamaForCausalLM.from_pretrained(tmp_path / "policy")
    assert max((p - q).abs().max().item() for p, q in zip(model.parameters(), initial.parameters())) > 1e-5
