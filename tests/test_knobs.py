"""Every knob a paper command turns, run in a script on the tiny task (their maths is checked by hand in the *_math.py
tests): several optimizer steps per batch, GRPO's loss types, IPO, best-of-k's sequence mean, gradient checkpointing,
and the off-policy correction's level, mode and cap. Each script's runs are forked from one process that imported the
libraries once (tests/forked_runs.py)."""

import os

import pytest
import torch
from conftest import TINY, algorithm_metrics, assert_finite, forked_runs, read_metrics, run_dir_of
from transformers import AutoModelForCausalLM

pytestmark = pytest.mark.slow  # runs scripts and vLLM engines: minutes


def runs(tmp_path, script, cases):
    """Each case (arguments) of `script` run to its end: a list of (metrics rows, run directory)."""
    outputs = [tmp_path / f"run{i}" for i in range(len(cases))]
    results = forked_runs(script, [[*case, "--eval-every", "0", "--output-dir", str(out)]
                                   for case, out in zip(cases, outputs)], tmp_path / "results.json")
    for case, (returncode, stdout, stderr, _) in zip(cases, results):
        assert returncode == 0, (case, stderr[-3000:])
        if script.startswith("grpo"):  # several steps a batch: the clip acts, and the run does not say it does not
            assert ("clip has no effect" in stdout) == ("--num-mini-batches" not in case), case
    found = [(read_metrics(run_dir_of(out)), run_dir_of(out)) for out in outputs]
    for rows, _ in found:
        assert_finite(rows)
    return found


def optimizer_steps(run_dir, update):
    """The policy's optimizer steps so far, as DeepSpeed counted them in checkpoint-<update>."""
    state = torch.load(os.path.join(run_dir, f"checkpoint-{update}", "training_state", "policy",
                                    "mp_rank_00_model_states.pt"), weights_only=False)
    return state["global_steps"]


# The paper's Figure 4 and its GSM8K PPO command turn --num-mini-batches and --num-ppo-epochs: each mini-batch of each
# epoch is an optimizer step of its own, so after the first one the ratio of the policy to the one that sampled is no
# longer 1 within the same update.
STEPS = [("rloo.py", []), ("ppo_vllm.py", ["--vllm-enforce-eager"])]


@pytest.mark.parametrize("script, arguments", STEPS, ids=[s for s, _ in STEPS])
def test_each_mini_batch_of_each_epoch_is_an_optimizer_step(tmp_path, script, arguments):
    ((rows, run_dir),) = runs(tmp_path, script, [[*arguments, "--num-mini-batches", "2", "--num-ppo-epochs", "2",
                                                  "--per-device-train-batch-size", "32", "--total-episodes", "128",
                                                  "--learning-rate", "1e-4"]])
    assert optimizer_steps(run_dir, 2) == 2 * 2 * 2  # updates x mini-batches x epochs
    assert rows[1]["val/ratio_var"] > 0 and rows[1]["policy/approxkl_avg"] > 0, rows[1]


# GRPO's five loss types, two mini-batches a batch (so that the clips and caps act on ratios that are not 1): each runs,
# and each is a different objective (their values at the second update all differ).
LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]


def test_every_grpo_loss_type_trains(tmp_path):
    found = runs(tmp_path, "grpo.py", [["--loss-type", loss, "--num-mini-batches", "2", "--per-device-train-batch-size",
                                        "32", "--total-episodes", "128", "--learning-rate", "1e-4"]
                                       for loss in LOSS_TYPES])
    losses = [rows[2]["loss/policy_avg"] for rows, _ in found]
    assert all(abs(a - b) > 1e-7 for i, a in enumerate(losses) for b in losses[i + 1:]), dict(zip(LOSS_TYPES, losses))
    assert all(optimizer_steps(run_dir, 2) == 4 for _, run_dir in found)


def test_ipo_starts_at_one_over_four_beta_squared_and_best_of_k_averages_over_responses(tmp_path):
    """Online DPO's IPO: before the first step the log-ratios are 0, so its loss is (0 - 1/(2 beta))^2 = 25 at beta 0.1.
    Best-of-k's --nll-mean sequence sums each response's negative log-likelihood: on the same first batch (the same
    seed) its loss is the token mean's times the best responses' mean length, more than one token."""
    ((ipo, _),) = runs(tmp_path / "dpo", "online_dpo.py", [["--loss-type", "ipo", "--total-episodes", "64"]])
    assert ipo[1]["loss/policy_avg"] == pytest.approx(25, abs=1e-3)
    (token, _), (sequence, _) = runs(tmp_path / "bok", "bok.py", [["--total-episodes", "64"],
                                                                   ["--nll-mean", "sequence", "--total-episodes", "64"]])
    assert sequence[1]["objective/scores"] == token[1]["objective/scores"]
    assert sequence[1]["loss/policy_avg"] > 2 * token[1]["loss/policy_avg"] > 0


def test_gradient_checkpointing_changes_memory_not_what_is_learned(tmp_path):
    plain, checkpointed = (algorithm_metrics(rows) for rows, _ in runs(tmp_path, "rloo.py", [
        ["--total-episodes", "192", "--learning-rate", "1e-4"],
        ["--total-episodes", "192", "--learning-rate", "1e-4", "--gradient-checkpointing"]]))
    for a, b in zip(plain, checkpointed):
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)


def test_the_off_policy_correction_and_its_mask_mode_reach_the_loss(tmp_path):
    """rloo_vllm.py one update late: the importance weights at update 2 (from policy 0's batch, trained on by policy 1)
    are not 1, so the corrected loss differs from --is-cap 0's (no correction). Under --is-mode mask with a cap below
    every weight, every response leaves the loss: the first update leaves the policy exactly as it was. (The level and
    the mode as the loop passes them to the loss, by hand: test_drift.py M7.)"""
    common = ["--vllm-enforce-eager", "--learning-rate", "1e-3"]
    (masked, masked_dir), (sequence, _), (off, _) = runs(tmp_path, "rloo_vllm.py", [
        [*common, "--total-episodes", "64", "--is-mode", "mask", "--is-cap", "1e-9"],
        [*common, "--total-episodes", "128"],
        [*common, "--total-episodes", "128", "--is-cap", "0"]])
    assert masked[1]["async/is_truncated"] == 1 and masked[1]["async/is_mean"] == 0
    sft = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    trained = AutoModelForCausalLM.from_pretrained(os.path.join(masked_dir, "checkpoint-1"))
    assert all(torch.equal(p, q) for p, q in zip(sft.parameters(), trained.parameters()))
    # on-policy first: every weight 1 (to float32's agreement of the two engines)
    assert off[1]["loss/policy_avg"] == pytest.approx(sequence[1]["loss/policy_avg"], rel=1e-4, abs=1e-6)
    assert sequence[2]["async/is_ess"] < 1 - 1e-6
    assert abs(sequence[2]["loss/policy_avg"] - off[2]["loss/policy_avg"]) > 1e-6
