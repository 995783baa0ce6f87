"""The algorithm scripts run as a user runs them: defaults, learning, resume, DeepSpeed, bad input."""

import concurrent.futures
import dataclasses
import glob
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import typing

import pytest
import torch
from conftest import (ALGORITHMS, ROOT, SCRIPTS, SHIPPED, TINY, algorithm_metrics, assert_bad_input,
                      assert_bad_input_result, assert_finite, bad_path, forked_runs, read_metrics, run, run_dir_of,
                      run_script)
from transformers import AutoModelForCausalLM, AutoTokenizer

pytestmark = pytest.mark.slow  # runs scripts or vLLM engines: minutes
DEEPSPEED = os.path.join(os.path.dirname(sys.executable), "deepspeed")


def free_port():
    """A free port for the launcher's rendezvous (its default, 29500, may be in use on a shared machine)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("script", ALGORITHMS)  # found by their shape: a new script too
def test_help_lists_every_argument_with_its_docstring(warm_runs, script):
    module = __import__(script[:-3])
    returncode, stdout, stderr, _ = warm_runs[script][0][0]
    assert returncode == 0, stderr[-2000:]
    helps = [stdout]
    if script == "rloo.py":  # the same tyro parsing in every script: one check under the launcher is enough
        helps.append(run([DEEPSPEED, "--num_accelerators", "1", script, "--help"], env={"COLUMNS": "300"}).stdout)
    for text in helps:
        text = " ".join(re.sub("[│╭╮╰╯─]", " ", text).split())
        for field in module.Args.__dataclass_fields__:
            assert f"--{field.replace('_', '-')}" in text, field
        assert "(the off-policy knob)" in text
        if script not in SHIPPED:  # a research copy says what it says
            continue
        assert ("responses sampled per prompt" in text) == (not script.startswith("ppo"))  # PPO samples one
        if script.startswith("grpo"):  # the defaults each loss type's paper ran
            assert "(default by --loss-type: 0.2, dapo 0.28, gspo 4e-4, cispo 4: its weight's cap of 5)" in text


# DAPO's token mean spans the mini-batch: grpo.py divides each micro-batch's token sum by the mini-batch's tokens
# over ranks x accumulation steps (all-reduced), so that DeepSpeed's averaging over micro-batches and ranks gives
# one mean over every token. Two accumulated micro-batches must then step as one does (ranks divide the same way).
ONE_STEP = [("rloo.py", []), ("grpo.py", ["--loss-type", "dapo"])]


@pytest.mark.parametrize("script, arguments", ONE_STEP, ids=[s for s, _ in ONE_STEP])
def test_one_step_batches_reuse_the_training_forward_and_match_accumulated_micro_batches(tmp_path, script, arguments):
    """A batch trained in one step (the default: one epoch, one micro-batch) takes the policy's log-probabilities
    from the training forward, where the ratio is exactly 1; with two accumulated micro-batches they come from a
    separate no-grad pass. The optimizer steps are the same."""
    common = [script, *arguments, "--total-episodes", "192", "--eval-every", "0", "--num-eval-prompts", "64"]
    run_script(*common, "--output-dir", str(tmp_path / "one"))
    run_script(*common, "--per-device-train-batch-size", "32", "--gradient-accumulation-steps", "2",
               "--output-dir", str(tmp_path / "two"))
    one, two = (algorithm_metrics(read_metrics(run_dir_of(tmp_path / name))) for name in ("one", "two"))
    assert len(one) == len(two) == 4 and all(row["val/ratio"] == 1.0 for row in one[1:])
    for a, b in zip(one, two):
        for key in a.keys() - {"policy/entropy_avg"}:  # a mean of per-micro-batch token means
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-6), (a["update"], key)


def launch_two_processes(tmp_path, port, command, nodes):
    """`deepspeed` with two processes: on one node, or on two nodes of one process each, started as on a
    cluster without ssh (one launcher per node with --no_ssh, its --node_rank and node 0's address; here both
    on the loopback address). Returns each node's output."""
    try:
        return launch(tmp_path, port, command, nodes)
    finally:  # DeepSpeed's CPU op leaves 64 MB a rank, named by the port
        for left in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.remove(left)


def launch(tmp_path, port, command, nodes):
    if nodes == 1:
        return [run([DEEPSPEED, "--num_accelerators", "2", "--master_port", str(port), *command]).stdout]
    hostfile, logs = tmp_path / "hostfile", [tmp_path / f"node{rank}.log" for rank in (0, 1)]
    hostfile.write_text("node0 slots=1\nnode1 slots=1\n")
    launchers = []
    try:
        for rank, log in enumerate(logs):
            with open(log, "w") as f:
                launchers.append(subprocess.Popen(
                    [DEEPSPEED, "--hostfile", str(hostfile), "--no_ssh", "--node_rank", str(rank), "--master_addr",
                     "127.0.0.1", "--master_port", str(port), *command], cwd=ROOT, stdout=f, stderr=subprocess.STDOUT,
                    env={**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}))
        codes = [launcher.wait(timeout=600) for launcher in launchers]
    finally:
        for launcher in launchers:
            launcher.kill() if launcher.poll() is None else None
    outputs = [log.read_text() for log in logs]
    assert codes == [0, 0], [output[-3000:] for output in outputs]
    return outputs


# (script, its own arguments, updates of 2 ranks x 32 responses, whether ZeRO-3 runs on two nodes). rloo_vllm.py
# runs 5 updates 2 policies late: batches 4 and 5 come from weights that rank 0 gathered (ZeRO-3, module by module)
# and handed to vLLM in memory (under ZeRO-2 through files), and the off-policy correction weights them. The other
# scripts share its ranks' plumbing (distributed.py, checkpoints.py, held_out.py), and the *_vllm.py its generator
# and hand-off. Two nodes of one process each must train as one node of two does: the same numbers, vLLM on node 0
# alone. It evaluates 65 prompts (the learner generating, as every script does), 33 on rank 0 (two batches of 32) and
# 32 on rank 1: under ZeRO-3 both must run two. The ZeRO-3 run is then resumed from its checkpoint-3 (its later files
# removed, as a kill after that checkpoint leaves them), each rank restoring its shard, its random states and, on rank
# 0, the two batches in flight: the resumed updates 4 and 5 and their evaluation must be the uninterrupted run's.
TWO_PROCESS = [("rloo_vllm.py", ["--off-policy-steps", "2", "--vllm-enforce-eager", "--num-eval-prompts", "65"], 5,
                True)]
@pytest.mark.parametrize("script, arguments, updates, two_nodes", TWO_PROCESS, ids=[t[0] for t in TWO_PROCESS])
def test_two_process_deepspeed_zero2_and_zero3_train_the_same_model(tmp_path, script, arguments, updates, two_nodes):
    runs = {}
    for stage in (2, 3):
        out, port = tmp_path / f"zero{stage}", free_port()
        nodes = 2 if two_nodes and stage == 3 else 1
        command = [script, *arguments, *(["--weight-sync", "file" if stage == 2 else "memory"]
                                         if script.endswith("_vllm.py") else []),
                   "--deepspeed-config", f"ds_configs/zero{stage}.json", "--per-device-train-batch-size", "32",
                   "--total-episodes", str(64 * updates), "--save-every", "3", "--output-dir", str(out)]
        outputs = launch_two_processes(tmp_path, port, command, nodes)
        if script.endswith("_vllm.py") and nodes == 2:  # the engine runs on node 0's rank 0 alone
            assert "EngineCore" in outputs[0] and "EngineCore" not in outputs[1]
        rows = read_metrics(run_dir_of(out))
        assert_finite(rows)
        assert [row["update"] for row in rows] == list(range(updates + 1)) and rows[-1]["episode"] == 64 * updates
        assert abs(rows[1]["objective/kl"]) < 1e-6  # on-policy
        if script == "rloo_vllm.py":  # two updates late, the importance weights are no longer 1
            assert [row["async/off_policy_steps"] for row in rows[1:]] == [0, 1, 2, 2, 2]
            assert rows[1]["async/mismatch_kl"] < 1e-6 and rows[1]["async/is_ess"] > 1 - 1e-6
            assert all(row["async/mismatch_kl"] > 1e-6 and row["async/is_ess"] < 1 - 1e-6 for row in rows[3:])
        model = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir_of(out), f"checkpoint-{updates}"))
        runs[stage] = rows, dict(model.named_parameters())
    resumed = tmp_path / "resumed" / os.path.basename(run_dir_of(out))
    shutil.copytree(run_dir_of(out), resumed, ignore=shutil.ignore_patterns(f"checkpoint-{updates}"))
    launch_two_processes(tmp_path, free_port(), [*command, "--resume", str(resumed / "checkpoint-3")], nodes)
    whole, got = algorithm_metrics(runs[3][0]), algorithm_metrics(read_metrics(resumed))
    assert [row["update"] for row in got] == list(range(updates + 1))
    for a, b in zip(whole, got):
        assert a.keys() == b.keys(), a["update"]
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)
    # Same weights, seeds and data: partitioning the parameters (ZeRO-3) changes nothing but
    # floating-point summation order, so both runs sample the same responses and log the same numbers.
    (rows2, weights2), (rows3, weights3) = runs[2], runs[3]
    for a, b in zip(rows2, rows3):
        for key in a:
            if key.startswith(("objective/", "eval/", "loss/")):
                assert b[key] == pytest.approx(a[key], rel=1e-3, abs=1e-4), (a["update"], key)
    # The checkpoints hold full, trained weights (ZeRO-3 gathers its shards to save them), the same in both.
    sft = dict(AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft")).named_parameters())
    assert weights3.keys() == sft.keys() and all(weights3[n].shape == sft[n].shape for n in sft)
    assert max((weights3[n] - sft[n]).abs().max().item() for n in sft) > 1e-5  # ~3 x lr
    assert max((weights3[n] - weights2[n]).abs().max().item() for n in sft) < 1e-5


# The per-rank state of the synchronous scripts on two ranks: DAPO's dynamic sampling (each rank refills its share of
# the batch; the ranks agree on the number of generation batches, which a checkpoint keeps) on the math task, where
# about half the groups score alike, and TBA's replay buffers (one per rank, saved by each; pre-filled with two batches
# by --buffer-prefill 100, which the resumed run must not repeat). Each run is resumed from its checkpoint-2 and must
# repeat updates 3 and 4.
TWO_RANKS = [["grpo.py", "--loss-type", "dapo", "--rule-reward", "last_number", "--sft-model-path",
              "assets/tiny_math/sft", "--dataset-name", "assets/tiny_math/data", "--num-eval-prompts", "16"],
             ["tba.py", "--num-eval-prompts", "32", "--buffer-prefill", "100"]]


@pytest.mark.parametrize("command", TWO_RANKS, ids=[c[0] for c in TWO_RANKS])
def test_two_ranks_keep_their_own_refills_and_buffers_and_resume_them(tmp_path, command):
    common = [*command, "--per-device-train-batch-size", "32", "--total-episodes", "256", "--eval-every", "0",
              "--save-every", "2"]
    launch_two_processes(tmp_path, free_port(), [*common, "--output-dir", str(tmp_path / "whole")], nodes=1)
    run_dir = run_dir_of(tmp_path / "whole")
    rows = read_metrics(run_dir)
    assert_finite(rows)
    assert [row["update"] for row in rows] == [0, 1, 2, 3, 4] and rows[-1]["episode"] == 256
    assert sorted(f for f in os.listdir(os.path.join(run_dir, "checkpoint-2", "training_state"))
                  if f.startswith("rng_rank")) == ["rng_rank0.pt", "rng_rank1.pt"]
    if command[0] == "grpo.py":  # every update took more than one generation batch to fill on both ranks
        assert all(row["objective/generation_batches"] >= 2 for row in rows[1:]), rows
    else:  # each rank's buffer starts with two batches of 8 prompts and grows with its own batches, replayed from
        assert [os.path.exists(os.path.join(run_dir, "checkpoint-2", "training_state", f"state_rank{r}.pt"))
                for r in (0, 1)] == [True, True]
        assert [row["buffer/prompts"] for row in rows[1:]] == [24, 32, 40, 48] and rows[4]["buffer/staleness_max"] > 0
    resumed = tmp_path / "resumed" / os.path.basename(run_dir)
    shutil.copytree(run_dir, resumed, ignore=shutil.ignore_patterns("checkpoint-4"))
    launch_two_processes(tmp_path, free_port(), [*common, "--resume", str(resumed / "checkpoint-2")], nodes=1)
    for a, b in zip(algorithm_metrics(rows), algorithm_metrics(read_metrics(resumed))):
        assert a.keys() == b.keys(), a["update"]
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)


# A signal at any point of an asynchronous run (the vLLM engine starting, or training with batches in flight and
# a checkpoint written) stops it within seconds, non-zero, leaving no process, weight directory or partial
# checkpoint. The signal goes to the script alone, as `kill PID` sends it: its engine processes must be ended by it.
# Both signals take the same path (SIGINT while training and SIGTERM while starting also passed: 30-50 s each).
KILLS = [(signal.SIGINT, "starting"), (signal.SIGTERM, "training")]


@pytest.mark.parametrize("signum, when", KILLS, ids=[f"{s.name} while {w}" for s, w in KILLS])
def test_a_signal_stops_an_asynchronous_run_and_leaves_nothing_behind(tmp_path, signum, when):
    import psutil
    out = tmp_path / "run"
    with open(tmp_path / "log", "w") as log:
        process = subprocess.Popen(
            [sys.executable, "rloo_vllm.py", "--off-policy-steps", "2", "--vllm-enforce-eager", "--total-episodes",
             "6400", "--save-every", "2", "--eval-every", "1000", "--output-dir", str(out)],
            cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"}, stdout=log, stderr=log, start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as in a terminal, not CI's background job
    try:
        me, deadline = psutil.Process(process.pid), time.time() + 300
        def engine_started():
            try:
                return any(p.name().startswith("VLLM::") for p in me.children(recursive=True))
            except psutil.NoSuchProcess:
                return False

        def ready():
            if when == "starting":  # vLLM's engine process is up and the first update not yet logged
                return engine_started() and not glob.glob(f"{out}/*__*/metrics.jsonl")
            return len(glob.glob(f"{out}/*__*/metrics.jsonl")) and len(read_metrics(run_dir_of(out))) >= 4
        while not ready():
            assert process.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-3000:]
            time.sleep(0.2)
        family = me.children(recursive=True)
        start = time.time()
        process.send_signal(signum)
        returncode = process.wait(timeout=60)
        took = time.time() - start
        # multiprocessing's resource tracker exits on its own once it reads the end of its pipe: give it a moment
        alive = [p for p in psutil.wait_procs(family, timeout=10)[1] if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
    # Most of the time is vLLM's engine ending on the SIGTERM vLLM's shutdown sends it: 7-8 s on an idle machine, 20.9 s
    # once in CI beside the other test process (its bound was 20 s then).
    assert returncode != 0 and took < 40, (returncode, took, (tmp_path / "log").read_text()[-3000:])
    assert family and not alive, [p.pid for p in alive]
    assert not glob.glob(f"/dev/shm/*-{process.pid}-weights") + glob.glob(f"{out}/*__*/*-weights")
    assert not glob.glob(f"{out}/*__*/*.tmp")
    if when == "training":
        assert os.path.isfile(os.path.join(run_dir_of(out), "checkpoint-2", "generated_batches.json"))


def test_a_full_disk_while_saving_fails_in_one_line_and_keeps_the_last_checkpoint(tmp_path):
    """A *_vllm.py run (--sync) on a 16 MiB tmpfs, which holds the tiny task's first checkpoint (11 MiB) but not a
    second beside it: one line, exit 1, the partial checkpoint removed, checkpoint-2 whole, vLLM's engine and the
    handed-over weights gone. save_checkpoint (checkpoints.py) serves every script."""
    import psutil
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(disk)], check=True)
    try:
        process = subprocess.Popen(
            [sys.executable, "rloo_vllm.py", "--sync", "--vllm-enforce-eager", "--total-episodes", "256", "--eval-every",
             "4", "--save-every", "2", "--output-dir", str(disk)], cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"},
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
        family, names = {}, set()  # every process the run starts, seen while it runs

        def watch():
            while process.poll() is None:
                try:
                    for child in psutil.Process(process.pid).children(recursive=True):
                        family[child.pid] = child
                        names.add(child.name())
                except psutil.NoSuchProcess:
                    pass
                time.sleep(0.2)
        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        stderr = process.communicate(timeout=600)[1]
        watcher.join()
        alive = [p for p in psutil.wait_procs(list(family.values()), timeout=10)[1] if p.status() != psutil.STATUS_ZOMBIE]
        run_dir = run_dir_of(disk)
        kept = sorted(os.listdir(run_dir))
        with open(os.path.join(run_dir, "checkpoint-2", "trainer_state.json")) as f:
            update = json.load(f)["update"]
        with open(os.path.join(run_dir, "checkpoint-2", "generated_batches.json")) as f:
            batches = json.load(f)
        rows = read_metrics(run_dir)
        AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "checkpoint-2"))
    finally:
        os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
        subprocess.run(["umount", str(disk)], check=True)
    errors = re.findall(r"error: .*", stderr)  # after the progress bar, on its line
    assert process.returncode == 1 and len(errors) == 1, stderr[-3000:]
    assert errors[0].startswith(f"error: could not write {run_dir}/checkpoint-4 (") and "MiB free on its disk" in errors[0]
    # (trace.json: the run's timeline, written as it ends in the error; --sync: no batch ahead)
    assert kept == ["checkpoint-2", "metrics.jsonl", "trace.json"] and update == 2 and batches == []
    # On-policy (--sync) in float32, vLLM's and the learner's log-probabilities agree: the weights are 1.
    assert [row["async/off_policy_steps"] for row in rows[1:]] == [0, 0, 0, 0]
    assert all(row["async/mismatch_kl"] < 1e-5 and row["async/is_ess"] > 1 - 1e-5 for row in rows[1:])
    assert any(name.startswith("VLLM::") for name in names) and not alive, (names, [p.pid for p in alive])
    assert not glob.glob(f"/dev/shm/*-{process.pid}-weights")


BAD_INPUT = [  # (script, arguments, the argument the error must name)
    *[("rloo.py", arguments, argument) for arguments, argument in [
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
        (["--learning-rate", "-1e-5"], "--learning-rate"),
        (["--temperature", "nan"], "--temperature"),
        (["--sft-model-path", "CORRUPT_CONFIG"], "--sft-model-path"),
        (["--sft-model-path", "A_FILE"], "--sft-model-path"),
        (["--reward-model-path", "NO_TOKENIZER"], "--reward-model-path"),
        (["--reward-model-path", "assets/tiny/sft"], "--reward-model-path"),  # a policy, not a reward model
        (["--dataset-name", "EMPTY_SPLIT"], "--dataset-name"),
        (["--dataset-name", "NOT_JSON_LINES"], "--dataset-name"),
        (["--dataset-name", "EMPTY_TRAIN_FILE"], "--dataset-name"),
        (["--resume", "PPO_CHECKPOINT"], "--resume"),
        (["--resume", "BROKEN_CHECKPOINT"], "--resume"),
        (["--resume", "RLOO_RUN_K4"], "--resume"),  # other batches than the run it resumes
        (["--k", "4", "--resume", "RLOO_RUN_K4", "--bf16"], "--resume"),  # DeepSpeed's files are named by bf16
        (["--sft-model-path", "assets/tiny/reward"], "--sft-model-path"),  # a reward model, not a policy
        (["--deepspeed-config", "NOT_JSON"], "--deepspeed-config"),
        (["--output-dir", "A_FILE"], "--output-dir"),
        (["--kl-coef", "-0.1"], "--kl-coef"),
        (["--cliprange", "0"], "--cliprange"),
        (["--rule-reward", "last_number"], "--answer-column"),  # the tiny task has no answers
        (["--rule-reward", "exact_match"], "--rule-reward"),
        (["--reward-model-path", "None"], "--reward-model-path"),
        (["--sft-model-path", "assets/tiny_math/sft", "--dataset-name", "CHAT_DATASET", "--rule-reward",
          "last_number"], "--dataset-name"),  # chat prompts, a tokenizer without a chat template
    ]],
    ("ppo_vllm.py", ["--rule-reward", "last_number", "--answer-column", "solution", "--dataset-name",
                     "assets/tiny_math/data", "--sft-model-path", "assets/tiny_math/sft"], "--answer-column"),
    # The other scripts share every check but their own `validate` (checks.py).
    ("online_dpo.py", ["--k", "1"], "--k"),
    ("online_dpo.py", ["--k", "4", "--per-device-train-batch-size", "66"], "--k"),
    ("online_dpo.py", ["--beta", "0"], "--beta"),
    ("online_dpo.py", ["--loss-type", "hinge"], "--loss-type"),
    ("online_dpo.py", ["--response-length", "100"], "--response-length"),
    ("grpo.py", ["--loss-type", "ppo"], "--loss-type"),
    ("grpo.py", ["--k", "1"], "--k"),
    ("grpo.py", ["--beta", "-0.1"], "--beta"),
    ("grpo_vllm.py", ["--cliprange-high", "0"], "--cliprange-high"),
    ("grpo_vllm.py", ["--loss-type", "dapo", "--cliprange-low", "-1"], "--cliprange-low"),
    ("bok.py", ["--k", "1"], "--k"),
    ("bok.py", ["--k", "3"], "--k"),
    ("bok.py", ["--total-episodes", "10"], "--total-episodes"),
    ("ppo.py", ["--gamma", "1.5"], "--gamma"),
    ("ppo.py", ["--lam", "-0.1"], "--lam"),
    ("ppo.py", ["--vf-coef", "0"], "--vf-coef"),
    ("ppo.py", ["--cliprange-value", "0"], "--cliprange-value"),
    ("ppo.py", ["--total-episodes", "10"], "--total-episodes"),
    ("online_dpo_vllm.py", ["--off-policy-steps", "0"], "--off-policy-steps"),
    ("online_dpo_vllm.py", ["--vllm-cpu-cores", "100000"], "--vllm-cpu-cores"),
    ("online_dpo_vllm.py", ["--generation-timeout", "0"], "--generation-timeout"),
    ("bok_vllm.py", ["--weight-sync", "disk"], "--weight-sync"),
    ("online_dpo_vllm.py", ["--k", "3"], "--k"),
    ("rloo_vllm.py", ["--is-cap", "-1"], "--is-cap"),
    ("ppo_vllm.py", ["--is-cap", "inf"], "--is-cap"),
    ("rloo_vllm.py", ["--is-level", "token"], "--is-level"),  # RLOO's ratio is per response
    ("ppo_vllm.py", ["--is-level", "tokens"], "--is-level"),
    ("grpo_vllm.py", ["--is-mode", "clip"], "--is-mode"),
    ("ppo_vllm.py", ["--off-policy-steps", "0"], "--off-policy-steps"),
    ("bok_vllm.py", ["--k", "3"], "--k"),
    ("rloo_vllm.py", ["--seed", str(2**32)], "--seed"),  # would overflow vLLM's sampling seed after loading
    ("online_dpo_vllm.py", ["--sync", "--resume", "ASYNC_RUN"], "--resume"),  # its saved batches are stale
    # A row of the wrong type, in any script (data.py): a number as `query`, a text as `messages`, no answer; a ZeRO
    # stage that does not exist; --vllm-gpu on a machine without GPUs (vLLM and the run would go on on the CPU).
    ("rloo.py", ["--dataset-name", "NUMBER_QUERY"], "--dataset-name"),
    ("grpo_vllm.py", ["--dataset-name", "NUMBER_QUERY"], "--dataset-name"),
    ("online_dpo.py", ["--dataset-name", "STRING_MESSAGES"], "--dataset-name"),
    ("bok.py", ["--rule-reward", "last_number", "--dataset-name", "NULL_ANSWER", "--sft-model-path",
                "assets/tiny_math/sft"], "--answer-column"),
    ("grpo.py", ["--deepspeed-config", "STAGE_4"], "--deepspeed-config"),
    # Every other script meets a bad row or a setting DeepSpeed rejects before its models load, as the walk's
    # scripts do (test_every_dataset_field_and_deepspeed_setting_...).
    ("ppo.py", ["--dataset-name", "NUMBER_QUERY"], "--dataset-name"),
    ("online_dpo_vllm.py", ["--dataset-name", "STRING_MESSAGES"], "--dataset-name"),
    ("rloo_vllm.py", ["--dataset-name", "NUMBER_QUERY"], "--dataset-name"),
    ("ppo_vllm.py", ["--deepspeed-config", "OVERLAP_MAYBE"], "--deepspeed-config"),
    ("bok_vllm.py", ["--deepspeed-config", "OVERLAP_MAYBE"], "--deepspeed-config"),
    ("online_dpo.py", ["--deepspeed-config", "OVERLAP_MAYBE"], "--deepspeed-config"),
    ("bok_vllm.py", ["--vllm-gpu", "0"], "--vllm-gpu"),
    # LoRA: any dropout (sampling has none), a layer the policy lacks, a rank vLLM cannot serve, the whole-weight
    # transfer with an adapter.
    ("rloo.py", ["--lora-rank", "8", "--lora-dropout", "0.1"], "--lora-dropout"),
    ("rloo.py", ["--lora-rank", "8", "--lora-target-modules", "q_proj,v_proj"], "--lora-target-modules"),
    ("rloo_vllm.py", ["--lora-rank", "1024"], "--lora-rank"),
    ("rloo_vllm.py", ["--lora-rank", "8", "--weight-sync", "memory"], "--weight-sync"),
    # Streaming generation with room for no prompt.
    ("ppo_vllm.py", ["--generation", "streaming", "--max-in-flight", "0"], "--max-in-flight"),
    ("rloo.py", ["--k", "4", "--resume", "RLOO_RUN_K4", "--stop-token", "no such token"], "--stop-token"),  # found
    # once the tokenizer has loaded, and still before anything is written into the run it resumes
    # Episodes of turns: no turn, a call or a result without its place or its end, an end that is not one token of the
    # tokenizer (found once it has loaded).
    ("grpo_tools_vllm.py", ["--max-turns", "0"], "--max-turns"),
    ("grpo_tools_vllm.py", ["--tool-call", "<calc>"], "--tool-call"),
    ("grpo_tools_vllm.py", ["--tool-result", "<result>{}"], "--tool-result"),
    ("grpo_tools_vllm.py", ["--tool-call", "<calc>{}</calculation>"], "--tool-call"),
]


@pytest.fixture(scope="module")
def warm_runs(tmp_path_factory):
    """Each script's `--help` and its BAD_INPUT cases, forked from one process per script that imported the
    libraries once (forked_runs: a case is then about a second, not 5-8 s), two scripts at a time, each run up to the
    loading of its first model (forked_runs' `checks` mode): every bad input must be found before any model loads.
    Returns {script: [((exit code, stdout, stderr, seconds), its output directory, whether its files, runs among
    them, are as they were)]}, --help first, then the script's cases in BAD_INPUT's order."""
    def files_under(directory):
        return {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}

    bad_input = {case: tmp_path_factory.mktemp(f"bad_input_{case}") for case in range(len(BAD_INPUT))}
    forked = {script: tmp_path_factory.mktemp("forked") for script in ALGORITHMS}  # (mktemp: not thread-safe)

    def one(script):
        cases, outputs = [["--help"]], [None]
        for case, (name, arguments, _) in enumerate(BAD_INPUT):
            if name == script:
                tmp = bad_input[case]
                arguments = [bad_path(tmp, a) if a.isupper() else a for a in arguments]
                cases.append([*arguments, *([] if "--output-dir" in arguments else ["--output-dir", str(tmp)])])
                outputs.append(tmp)
        before = [tmp and files_under(tmp) for tmp in outputs]
        results = forked_runs(script, cases, forked[script] / f"{script}.json", {"COLUMNS": "300"},
                              mode="checks")  # a case that got as far as loading a model exits 3, not 2
        return script, [(result, tmp, tmp is None or files_under(tmp) == files)
                        for result, tmp, files in zip(results, outputs, before)]

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return dict(pool.map(one, ALGORITHMS))


@pytest.mark.parametrize("case", range(len(BAD_INPUT)), ids=[f"{s} {' '.join(a)}" for s, a, _ in BAD_INPUT])
def test_bad_input_exits_2_with_one_line_naming_the_argument(warm_runs, case):
    script, _, argument = BAD_INPUT[case]
    position = 1 + [s for s, _, _ in BAD_INPUT[:case]].count(script)
    (returncode, _, stderr, seconds), tmp, untouched = warm_runs[script][position]
    assert_bad_input_result(returncode, stderr, seconds, argument)
    assert set(os.listdir(tmp)) <= {"bad"} and untouched  # nothing was run or written, not even into a resumed run
    if any(kind in BAD_INPUT[case][1] for kind in ("NUMBER_QUERY", "STRING_MESSAGES", "NULL_ANSWER")):
        assert re.search(r"^error: --[a-z-]+: split 'train' of \S+, row 1: ", stderr, re.M), stderr[-2000:]


# The argument walk: every number of every script's Args, out of its domain (a word; a fraction where a count goes;
# NaN and infinity; -1 and 0 but where they mean something: below), and every choice given an unknown value, must end
# in one line naming that argument, exit code 2: parsed and checked (validate) in a forked run each.
WALK_SCRIPTS = SCRIPTS  # every script, found by its shape
COMPUTED = {"local_rank", "world_size", "local_batch_size", "batch_size", "num_updates"}  # set by the script
NEGATIVE_OK = {"missing_eos_penalty"}
ZERO_OK = {"seed", "missing_eos_penalty", "kl_coef", "beta", "gamma", "lam", "is_cap", "eval_every", "save_every",
           "check_weights_every", "overlong_buffer", "dynamic_sampling_rounds", "beta_anneal_updates", "beta_cut_update",
           "recent_prob", "inv_temp", "buffer_prefill", "lora_rank",
           "lora_dropout"}  # (0: none, never, uniformly, or full fine-tuning)
CHOICES = ("missing_eos_mode", "loss_type", "is_level", "is_mode", "weight_sync", "rule_reward", "backend")


# Paths: each missing, of the wrong kind (a file where a directory goes, and the reverse) or empty.
DIRECTORIES = ("sft_model_path", "reward_model_path", "gold_reward_model_path", "dataset_name", "resume", "checkpoints")
MODELS = ("sft_model_path", "reward_model_path", "gold_reward_model_path", "checkpoints")
# A ratio's lower clip range: the ratio is clipped below at 1 - it, so 1 or more turns the clip upside down.
LOWER_CLIPS = ("cliprange", "cliprange_low")
# The fields of the DeepSpeed config the scripts read (the stage, the offload devices, no fp16, gradient clipping), out
# of their domain; checks.check_files finds them in validate().
DEEPSPEED_CONFIGS = ['[1]', '{}', '{"zero_optimization": [2]}', '{"zero_optimization": {}}',
                     '{"zero_optimization": {"stage": "two"}}', '{"zero_optimization": {"stage": true}}',
                     '{"zero_optimization": {"stage": -1}}', '{"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}',
                     '{"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "gpu"}}}',
                     '{"zero_optimization": {"stage": 3, "offload_param": {"device": "gpu"}}}',
                     '{"zero_optimization": {"stage": 2}, "fp16": {"enabled": true}}',
                     '{"zero_optimization": {"stage": 2}, "gradient_clipping": "auto"}',
                     '{"zero_optimization": {"stage": 2}, "gradient_clipping": -1}',
                     # values the script fills in from its arguments, contradicting them (DeepSpeed refuses these)
                     '{"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 3}',
                     '{"zero_optimization": {"stage": 2}, "gradient_accumulation_steps": 7}',
                     '{"zero_optimization": {"stage": 2}, "train_batch_size": 5}',
                     '{"zero_optimization": {"stage": 2}, "bf16": {"enabled": true}}']


def path_cases(script, tmp_path):
    """(argument, value) pairs of paths that `script` must reject."""
    fields = {field.name for field in dataclasses.fields(__import__(script[:-3]).Args)}
    (tmp_path / "empty").mkdir(exist_ok=True)
    (tmp_path / "empty.json").write_text("")
    cases = [(name, value) for name in DIRECTORIES if name in fields
             for value in ("missing/directory/x", "README.md", str(tmp_path / "empty"))]
    # A model on the hub that this machine cannot read (the walk runs with HF_HUB_OFFLINE=1: no cache holds it).
    cases += [(name, "some-org/no-such-model") for name in MODELS if name in fields]
    if "deepspeed_config" in fields:
        cases += [("deepspeed_config", value) for value in ("missing/x.json", str(tmp_path / "empty"),
                                                            str(tmp_path / "empty.json"))]
        for n, text in enumerate(DEEPSPEED_CONFIGS):
            (tmp_path / f"config{n}.json").write_text(text)
            cases.append(("deepspeed_config", str(tmp_path / f"config{n}.json")))
    if "output_dir" in fields:
        cases.append(("output_dir", "README.md"))
    if "output" in fields:  # evaluate.py's results file
        cases += [("output", str(tmp_path / "empty")), ("output", "missing/directory/results.json")]
    return [("--" + name.replace("_", "-"), value) for name, value in cases]


def walk_cases(script):
    """(argument, value) pairs of numbers and choices that `script` must reject."""
    cases = []
    for field in dataclasses.fields(__import__(script[:-3]).Args):
        kind = typing.get_args(field.type)[0] if typing.get_origin(field.type) is typing.Union else field.type
        flag = "--" + field.name.replace("_", "-")
        if field.name in COMPUTED:
            continue
        if kind in (int, float):
            values = ["word", "1.5"] if kind is int else ["word", "nan", "inf", "-inf"]
            zero_ok = ZERO_OK | ({"num_eval_prompts", "temperature"} if script == "evaluate.py" else set())  # all, greedy
            values += [v for v, ok in (("-1", NEGATIVE_OK), ("0", zero_ok)) if field.name not in ok]
            values += ["1", "1.5"] if field.name in LOWER_CLIPS else []
            cases += [(flag, value) for value in values]
        elif field.name in CHOICES:
            cases.append((flag, "unknown"))
    return cases


@pytest.fixture(scope="module")
def walks(tmp_path_factory):
    """{script: (its cases, their results)}, two scripts at a time (each walk is one process, one core)."""
    cases, directories = {}, {}
    for script in WALK_SCRIPTS:
        directories[script] = tmp_path_factory.mktemp("walk")
        cases[script] = walk_cases(script) + path_cases(script, directories[script])

    def one(script):
        base = ["--checkpoints", "assets/tiny/sft"] if script == "evaluate.py" else []
        return forked_runs(script, [[*base, flag, value] for flag, value in cases[script]],
                           directories[script] / "walk.json", env={"HF_HUB_OFFLINE": "1"}, mode="validate")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return {script: (cases[script], results) for script, results in zip(WALK_SCRIPTS, pool.map(one, WALK_SCRIPTS))}


@pytest.mark.parametrize("script", WALK_SCRIPTS)
def test_every_number_choice_and_path_out_of_its_domain_ends_in_one_line_naming_it(walks, script):
    cases, results = walks[script]
    wrong = []
    for (flag, value), (returncode, _, stderr, _) in zip(cases, results):
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        if not (returncode == 2 and len(errors) == 1 and errors[0].startswith(f"error: {flag}:")):
            wrong.append((flag, value, returncode, errors[:1] or stderr[-300:]))
    assert len(cases) >= 40 and not wrong, wrong


# The dataset's rows, each field a script reads missing, of the wrong type or empty (in the second row, after a good
# one), and what DeepSpeed itself checks of its config, found before any model loads: main() up to the first model
# (forked_runs' `checks` mode), in RLOO (all the synchronous scripts' data and DeepSpeed set-up) and the asynchronous
# GRPO (the *_vllm.py scripts'), and in evaluate.py the rows it reads; the other scripts in BAD_INPUT.
ROWS = {  # field: (a good row, the bad second rows, the extra arguments, the argument named)
    "query": ({"query": "hello"}, [{"other": "hello"}, {"query": 12}, {"query": ""}, {"query": ["hello"]}], [],
              "--dataset-name"),
    "messages": ({"messages": [{"role": "user", "content": "2 + 3?"}]},
                 [{"other": 1}, {"messages": "hello"}, {"messages": []}, {"messages": [{"role": "user"}]},
                  {"messages": [{"role": "user", "content": 5}]}],
                 ["--sft-model-path", "SMOLLM2"], "--dataset-name"),  # a tokenizer with a chat template
    "answer": ({"query": "2 + 3?", "answer": "5"}, [{"query": "2 + 4?"}, {"query": "2 + 4?", "answer": ""},
                                                     {"query": "2 + 4?", "answer": ["6"]}],
               ["--rule-reward", "last_number"], "--answer-column"),
    "reference": ({"query": "hello", "reference": "hi"}, [{"query": "hello"}, {"query": "hello", "reference": 12},
                                                           {"query": "hello", "reference": ""}],
                  ["--reference-column", "reference"], "--reference-column"),
}
DEEPSPEED_CHECKS = ['{"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}',
                    '{"zero_optimization": {"stage": 2, "no_such_field": 1}}',
                    '{"zero_optimization": {"stage": 2, "reduce_bucket_size": -5}}']


def row_cases(script, tmp_path, chat_model):
    """(arguments, how the error begins: the argument named, and for a dataset its split and row) of datasets with a
    bad second row (row 1) and of DeepSpeed configs that `script` must reject."""
    cases = []
    for field, (good, bad_rows, extra, argument) in ROWS.items():
        if field == "reference" and script != "evaluate.py":
            continue  # only evaluate.py reads references
        extra = [chat_model if value == "SMOLLM2" else value for value in extra]
        for n, bad in enumerate(bad_rows):
            path = tmp_path / f"{field}{n}"
            path.mkdir()
            for split in ("train", "test"):
                (path / f"{split}.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
            split = "test" if script == "evaluate.py" else "train"  # the split each reads first
            cases.append(([*extra, "--dataset-name", str(path)], f"{argument}: split '{split}' of {path}, row 1: "))
    if script != "evaluate.py":
        for n, text in enumerate(DEEPSPEED_CHECKS):
            (tmp_path / f"deepspeed{n}.json").write_text(text)
            cases.append((["--deepspeed-config", str(tmp_path / f"deepspeed{n}.json")], "--deepspeed-config:"))
    return cases


ROW_SCRIPTS = ["rloo.py", "grpo_vllm.py", "evaluate.py"]


@pytest.fixture(scope="module")
def row_checks(tmp_path_factory, smollm2):
    """{script: (its cases, their results)}, two scripts at a time."""
    cases, directories = {}, {}
    for script in ROW_SCRIPTS:
        directories[script] = tmp_path_factory.mktemp("rows")
        cases[script] = row_cases(script, directories[script], os.path.join(smollm2, "model"))

    def one(script):
        tmp = directories[script]
        base = ["--checkpoints", "assets/tiny/sft"] if script == "evaluate.py" else ["--output-dir", str(tmp / "runs")]
        return forked_runs(script, [[*base, *arguments] for arguments, _ in cases[script]], tmp / "rows.json",
                           mode="checks")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        return {script: (cases[script], results) for script, results in zip(ROW_SCRIPTS, pool.map(one, ROW_SCRIPTS))}


@pytest.mark.parametrize("script", ROW_SCRIPTS)
def test_every_dataset_field_and_deepspeed_setting_out_of_its_domain_ends_in_one_line_before_models_load(
        row_checks, script):
    cases, results = row_checks[script]
    wrong = []
    for (arguments, argument), (returncode, _, stderr, _) in zip(cases, results):
        errors = [line for line in stderr.splitlines() if line.startswith("error:")]
        if not (returncode == 2 and len(errors) == 1 and errors[0].startswith(f"error: {argument}")):
            wrong.append((arguments[-1], returncode, errors[:1] or stderr[-300:]))
    assert len(cases) >= 10 and not wrong, wrong


def test_a_diverging_policy_stops_at_that_update_in_one_line_and_saves_nothing(tmp_path):
    """A learning rate that blows the policy up (its outputs overflow after the first update): the run stops there,
    naming the update and the learning rate, before the next sampling would fail in torch, and before the checkpoint
    --save-every 1 asks for at that update."""
    result = run_script("rloo.py", "--learning-rate", "1e8", "--total-episodes", "256", "--per-device-train-batch-size",
                        "16", "--save-every", "1", "--eval-every", "0", "--output-dir", str(tmp_path), check=False)
    errors = [line for line in result.stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert errors == ["error: the policy diverged at update 1: its weights or outputs are inf or NaN; lower "
                      "--learning-rate (now 1e+08) or look for a non-finite reward; no checkpoint was written yet "
                      "(--save-every saves more often)"], errors
    assert not glob.glob(str(tmp_path / "*" / "checkpoint-*"))


def test_bad_input_in_a_process_of_its_own_as_a_user_runs_it():
    assert_bad_input("rloo_vllm.py", ["--is-cap", "-1"], "--is-cap")


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
