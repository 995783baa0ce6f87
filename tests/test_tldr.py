"""benchmark/tldr.sh reproduces the paper's TL;DR settings: its printed commands are checked against the
paper's values (its code's configs: github.com/mnoukhov/async_rlhf, configs/*_tldr*.yml, and the TRL 0.9.4
defaults it builds on), and every printed argument parses with the script it is for."""

import itertools
import shlex

import pytest
import tyro
from conftest import run

import bok
import evaluate
import online_dpo
import online_dpo_vllm
import ppo
import rloo

MODULES = {"rloo.py": rloo, "online_dpo.py": online_dpo, "bok.py": bok, "ppo.py": ppo,
           "online_dpo_vllm.py": online_dpo_vllm, "evaluate.py": evaluate}
PAPER = {
    "learning_rate": 3e-6, "temperature": 0.7, "response_length": 53, "max_prompt_length": 512,
    "missing_eos_mode": "replace", "missing_eos_penalty": -1.0, "num_ppo_epochs": 1, "num_mini_batches": 1,
    "deepspeed_config": "ds_configs/zero2.json",  # the paper's code has only a ZeRO-2 config, at every size
    "beta": 0.1, "kl_coef": 0.05, "k": 2, "gamma": 1.0, "lam": 0.95, "vf_coef": 0.1,
}
# Online DPO batches in prompts (pairs) and updates, and its pairs per device by size: async and sync on
# 3 training GPUs + vLLM on GPU 3 (configs/onlinedpo_pythia*_tldr_vllm_4gpu.yml), hf on 4 GPUs (*_tldr_4gpu.yml).
DPO_LAYOUT = {"async": (3, 504, 256), "sync": (3, 504, 256), "hf": (4, 512, 256)}
DPO_PAIRS_PER_DEVICE = {("async", "410m"): 21, ("async", "1b"): 8, ("async", "2.8b"): 6,
                        ("hf", "410m"): 32, ("hf", "1b"): 16, ("hf", "2.8b"): 4}
EVALUATION = {"response_length": 128, "temperature": 0.01, "max_prompt_length": 512,
              "gold_reward_model_path": "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"}
RUNS = [("online_dpo", size, mode) for size, mode in itertools.product(("410m", "1b", "2.8b"), DPO_LAYOUT)] + [
    (algorithm, size, "hf") for algorithm, size in itertools.product(("rloo", "bok", "ppo"), ("410m", "1b", "2.8b"))]


def _printed(algorithm, size, mode):
    lines = run(["bash", "benchmark/tldr.sh", "--print", algorithm, size, mode]).stdout.splitlines()
    train, evaluation = (shlex.split(line.split("#")[0]) for line in lines)
    return train, evaluation


def _parsed(command):
    """(launcher GPUs, script, its Args as the script would parse them)."""
    script = next(word for word in command if word.endswith(".py"))
    gpus = int(command[command.index("--num_gpus") + 1]) if command[0] == "deepspeed" else 1
    argv = command[command.index(script) + 1:]
    args = tyro.cli(MODULES[script].Args, args=argv)
    return gpus, script, args


@pytest.mark.parametrize("algorithm, size, mode", RUNS, ids=["-".join(r) for r in RUNS])
def test_tldr_commands_match_the_paper(algorithm, size, mode):
    train, evaluation = _printed(algorithm, size, mode)
    gpus, script, args = _parsed(train)
    for name, value in PAPER.items():
        if hasattr(args, name):
            assert getattr(args, name) == value, name
    assert args.sft_model_path == f"mnoukhov/pythia{size}-sft-tldr"
    assert args.reward_model_path == f"mnoukhov/pythia{size}-rm-tldr6.9b"
    batch = gpus * args.per_device_train_batch_size * args.gradient_accumulation_steps
    if algorithm == "online_dpo":
        expected_gpus, prompts, updates = DPO_LAYOUT[mode]
        assert (gpus, batch // 2, args.total_episodes // batch) == (expected_gpus, prompts, updates)
        assert args.total_episodes % batch == 0
        pairs = args.per_device_train_batch_size // 2
        assert pairs == DPO_PAIRS_PER_DEVICE[("async" if mode == "sync" else mode, size)]
        if mode == "hf":
            assert script == "online_dpo.py"
        else:  # the speed-up compares the same 3+1 layout, on-policy (--sync) against one update off-policy
            assert script == "online_dpo_vllm.py" and args.vllm_gpu == 3 and args.sync == (mode == "sync")
            assert args.off_policy_steps == 1
    else:
        assert (script, gpus, batch, args.total_episodes) == (f"{algorithm}.py", 4, 512, 131072)
    _, _, eval_args = _parsed(evaluation)
    for name, value in EVALUATION.items():
        assert getattr(eval_args, name) == value, name


def test_tldr_refuses_what_it_cannot_run():
    for arguments in (["rloo", "1b", "async"], ["online_dpo", "7b", "async"], ["online_dpo", "1b", "fast"]):
        result = run(["bash", "benchmark/tldr.sh", "--print", *arguments], check=False)
        assert result.returncode == 2 and result.stderr.startswith("error:"), arguments
