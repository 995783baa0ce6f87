"""benchmark/tldr.sh, gsm8k.sh and no_robots.sh reproduce the paper's settings: their printed commands are
checked against the paper's values (its code's configs: github.com/mnoukhov/async_rlhf, configs/*_tldr*.yml on
`main`, configs/*rho1b_gsm8k*.yml on `dev`, the TRL 0.9.4 defaults it builds on; for No Robots its appendix
table and the open-instruct command), and every printed argument parses with the script it is for."""

import itertools
import os
import re
import shlex

import pytest
import tyro
from conftest import ROOT, run

import bok
from data import load_prompts, load_tokenizer
import evaluate
import online_dpo
import online_dpo_vllm
import ppo
import ppo_vllm
import rloo
import rloo_vllm
import tba_vllm

MODULES = {"rloo.py": rloo, "online_dpo.py": online_dpo, "bok.py": bok, "ppo.py": ppo,
           "online_dpo_vllm.py": online_dpo_vllm, "rloo_vllm.py": rloo_vllm, "ppo_vllm.py": ppo_vllm,
           "tba_vllm.py": tba_vllm, "evaluate.py": evaluate}
PAPER = {
    "learning_rate": 3e-6, "temperature": 0.7, "response_length": 53, "max_prompt_length": 512,
    "missing_eos_mode": "replace", "missing_eos_penalty": -1.0, "num_ppo_epochs": 1, "num_mini_batches": 1,
    "deepspeed_config": "ds_configs/zero2.json",  # the paper's code has only a ZeRO-2 config, at every size
    "beta": 0.1, "kl_coef": 0.05, "k": 2, "gamma": 1.0, "lam": 0.95, "vf_coef": 0.1,
}
# The paper's arguments an algorithm has no use for (each other one of PAPER and GSM8K must be an argument of its
# script and hold the paper's value: a renamed argument fails, not skipped).
ABSENT = {"online_dpo": {"kl_coef", "gamma", "lam", "vf_coef"}, "rloo": {"beta", "gamma", "lam", "vf_coef"},
          "bok": {"beta", "kl_coef", "gamma", "lam", "vf_coef"}, "ppo": {"beta", "k"}}
# Online DPO batches in prompts (pairs) and updates, and its pairs per device by size: async and sync on
# 3 training GPUs + vLLM on GPU 3 (configs/onlinedpo_pythia*_tldr_vllm_4gpu.yml), hf on 4 GPUs (*_tldr_4gpu.yml).
DPO_LAYOUT = {"async": (3, 504, 256), "sync": (3, 504, 256), "hf": (4, 512, 256)}
DPO_PAIRS_PER_DEVICE = {("async", "410m"): 21, ("async", "1b"): 8, ("async", "2.8b"): 6,
                        ("hf", "410m"): 32, ("hf", "1b"): 16, ("hf", "2.8b"): 4}
EVALUATION = {"response_length": 128, "temperature": 0.01, "max_prompt_length": 512,
              "gold_reward_model_path": "cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr"}
RUNS = [("online_dpo", size, mode) for size, mode in itertools.product(("410m", "1b", "2.8b"), DPO_LAYOUT)] + [
    (algorithm, size, "hf") for algorithm, size in itertools.product(("rloo", "bok", "ppo"), ("410m", "1b", "2.8b"))]


def _printed_by(script, *arguments):
    """The commands a benchmark script prints, split as the shell would (without trailing comments)."""
    lines = run(["bash", f"benchmark/{script}", "--print", *arguments]).stdout.splitlines()
    return [shlex.split(line.split("   #")[0]) for line in lines]


def _printed(algorithm, size, mode):
    train, evaluation = _printed_by("tldr.sh", algorithm, size, mode)
    return train, evaluation


# The scripts with the off-policy correction (docs/off_policy_correction.md). The paper's code, and TBA's, weight no
# sample by an importance ratio: every paper command of these scripts turns it off (--is-cap 0), in both modes (--sync
# too: vLLM's and the learner's log-probabilities differ a little even on-policy, and the paper's code ignores that).
IS_CORRECTED = {"rloo_vllm.py", "ppo_vllm.py", "grpo_vllm.py"}


def _parsed(command):
    """(launcher GPUs, script, its Args as the script would parse them), after checking the off-policy correction:
    off where the script has one, no --is-cap where it has none (a script that gains one: check it against the
    paper)."""
    script = next(word for word in command if word.endswith(".py"))
    gpus = int(command[command.index("--num_gpus") + 1]) if command[0] == "deepspeed" else 1
    argv = command[command.index(script) + 1:]
    args = tyro.cli(MODULES[script].Args, args=argv)
    if script in IS_CORRECTED:
        assert args.is_cap == 0.0, f"{script}: the paper's code has no importance weights (--is-cap 0): {args.is_cap}"
    else:
        assert not hasattr(args, "is_cap"), f"{script} now has --is-cap: check it against the paper (IS_CORRECTED)"
    return gpus, script, args


def _assert_paper_values(args, algorithm, values):
    for name, value in values.items():
        if name in ABSENT[algorithm]:
            assert not hasattr(args, name), f"{algorithm} now has --{name}: check it against the paper (ABSENT)"
        else:
            assert getattr(args, name) == value, name


@pytest.mark.parametrize("algorithm, size, mode", RUNS, ids=["-".join(r) for r in RUNS])
def test_tldr_commands_match_the_paper(algorithm, size, mode):
    train, evaluation = _printed(algorithm, size, mode)
    gpus, script, args = _parsed(train)
    _assert_paper_values(args, algorithm, PAPER)
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
    elif algorithm == "bok":  # src/online_bok_trainer.py: 512 prompts sampled twice an update, 256 updates; its
        # loss sums each chosen response's token NLL (bo2_pythia410m_tldr.yml, 16 x 8 prompts per device)
        assert (script, gpus, batch, args.total_episodes) == ("bok.py", 4, 1024, 262144)
        assert args.nll_mean == "sequence" and args.per_device_train_batch_size % args.k == 0
    else:
        assert (script, gpus, batch, args.total_episodes) == (f"{algorithm}.py", 4, 512, 131072)
    _, _, eval_args = _parsed(evaluation)
    for name, value in EVALUATION.items():
        assert getattr(eval_args, name) == value, name


def test_tldr_refuses_what_it_cannot_run():
    for arguments in (["rloo", "1b", "async"], ["online_dpo", "7b", "async"], ["online_dpo", "1b", "fast"]):
        result = run(["bash", "benchmark/tldr.sh", "--print", *arguments], check=False)
        assert result.returncode == 2 and result.stderr.startswith("error:"), arguments


# GSM8K (configs/onlinedpo_rho1b_gsm8k_4a100_sync.yml, rloo_rho1b_gsm8k_4l40s.yml, ppovllm_rho1b_gsm8k.yml on
# the code's dev branch): script, k, responses an update on 3 training GPUs, updates, PPO epochs.
GSM8K = {"sft_model_path": "realtreetune/rho-1b-sft-GSM8K", "rule_reward": "last_number", "answer_column": "answer",
         "dataset_name": "runs/gsm8k/data", "temperature": 0.7, "response_length": 512, "missing_eos_penalty": 0.0,
         "learning_rate": 3e-6, "deepspeed_config": "ds_configs/zero2.json", "vllm_gpu": 3, "num_mini_batches": 1,
         "beta": 0.1, "kl_coef": 0.05}
GSM8K_RUNS = {"online_dpo": ("online_dpo_vllm.py", 4, 264 * 4, 512, 1), "rloo": ("rloo_vllm.py", 4, 252, 2048, 1),
              "ppo": ("ppo_vllm.py", None, 252, 2048, 2)}


@pytest.mark.parametrize("algorithm, mode", list(itertools.product(GSM8K_RUNS, ("async", "sync"))))
def test_gsm8k_commands_match_the_paper_code(algorithm, mode):
    _, train, evaluation = _printed_by("gsm8k.sh", algorithm, mode)
    gpus, script, args = _parsed(train)
    _assert_paper_values(args, algorithm, GSM8K)
    batch = gpus * args.per_device_train_batch_size * args.gradient_accumulation_steps
    expected_script, k, expected_batch, updates, epochs = GSM8K_RUNS[algorithm]
    assert (script, gpus, batch, args.total_episodes // batch) == (expected_script, 3, expected_batch, updates)
    assert args.total_episodes % batch == 0 and getattr(args, "k", None) == k and args.num_ppo_epochs == epochs
    assert args.sync == (mode == "sync") and args.off_policy_steps == 1
    _, _, eval_args = _parsed(evaluation)
    assert (eval_args.rule_reward, eval_args.temperature, eval_args.response_length, eval_args.dataset_eval_split) == (
        "last_number", 0.0, 512, "test")


def test_gsm8k_data_preparation_writes_what_the_scripts_read(tmp_path, monkeypatch):
    import datasets

    (prepare, *_), data = _printed_by("gsm8k.sh", "rloo", "async"), tmp_path / "gsm8k"
    assert prepare[:2] == ["python", "-c"]
    rows = [{"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in "
                         "May. How many clips did Natalia sell altogether in April and May?",
             "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
                       "altogether in April and May.\n#### 72"}]
    monkeypatch.setattr(datasets, "load_dataset", lambda name, config, split: datasets.Dataset.from_list(rows))
    exec(prepare[2].replace("runs/gsm8k/data", str(data)), {})
    args = type("Args", (), dict(dataset_name=str(data), dataset_train_split="train", dataset_eval_split="test",
                                 max_prompt_length=512, rule_reward="last_number", answer_column="answer"))
    tokenizer = load_tokenizer(os.path.join(ROOT, "assets", "tiny", "sft"), False)
    _, (prompt,), _, (answer,) = load_prompts(args, tokenizer)
    assert tokenizer.decode(prompt) == f"[MATH_TASK] Problem:\n{rows[0]['question']}\n\nSolution:"
    assert rloo.last_number_reward(" 48/2 = 24 in May, 48 + 24 = 72 in all. #### 72", answer) == 1.0
    assert rloo.last_number_reward(" 48 + 24 = 72. #### 24", answer) == 0.0


NO_ROBOTS = {"sft_model_path": "runs/no_robots/models/sft", "reward_model_path": "runs/no_robots/models/reward",
             "dataset_name": "HuggingFaceH4/no_robots", "learning_rate": 8e-7, "temperature": 0.7, "beta": 0.03,
             "k": 2, "max_prompt_length": 512, "response_length": 1024, "missing_eos_mode": "replace",
             "missing_eos_penalty": -10.0, "deepspeed_config": "ds_configs/zero3.json", "vllm_gpu": 7,
             "num_ppo_epochs": 1, "num_mini_batches": 1}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_no_robots_command_matches_the_paper(mode):
    download_sft, download_rm, _, train = _printed_by("no_robots.sh", mode)
    assert download_sft[download_sft.index("--revision") + 1].startswith("costa_finetune_tulu3_8b_norobot__meta-llama")
    assert download_rm[:3] == ["hf", "download", "vwxyzjn/reward_modeling__allenai_open_instruct_dev"]
    gpus, script, args = _parsed(train)
    for name, value in NO_ROBOTS.items():
        assert getattr(args, name) == value, name
    batch = gpus * args.per_device_train_batch_size * args.gradient_accumulation_steps
    # 7 training GPUs x 32 accumulation steps x one pair; 100,000 prompts
    assert (script, gpus, batch // 2, args.total_episodes // 2) == ("online_dpo_vllm.py", 7, 224, 100_000)
    assert args.sync == (mode == "sync")


def test_no_robots_chat_template_is_the_tulu_format():
    with open(os.path.join(ROOT, "benchmark", "no_robots.sh")) as f:
        (template,) = re.findall(r"<<'EOF'\n(.*?)\nEOF", f.read(), re.S)
    tokenizer = load_tokenizer(os.path.join(ROOT, "assets", "tiny", "sft"), False)
    tokenizer.chat_template = template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Why?"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == ("<|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello<|endoftext|>\n<|user|>\nWhy?\n"
                        "<|assistant|>\n")


# TBA's own settings (github.com/bbartoldson/TBA: configs/tba_pythia2.8b_tldr.yml, tba_rho1b_gsm8k.yml,
# launch_training_*.sh and the TBAConfig* defaults): k, responses a step, steps, learning rate, response length,
# beta from -> to (reached at step 1 + anneal, or from the cut's step), newest-batch probability, inv_temp, the
# weights' staleness (TBA's mean for its sync interval k: (3k - 1) / 2, rounded up), the responses in the buffer
# before the first step.
TBA = {"tldr": (20, 160, 256, 3e-6, 128, (1.0, 0.05, 128, 32), 0.5, 1.0, 15, 10000),
       "gsm8k": (20, 140, 700, 1e-5, 512, (0.014, 0.004, 500, 0), 0.95, 0.0, 3, 500)}


@pytest.mark.parametrize("task", TBA)
def test_tba_commands_match_tbas_code(task):
    train, evaluation = _printed_by("tba.sh", task, *(["1b"] if task == "tldr" else []))
    gpus, script, args = _parsed(train)
    k, batch, steps, lr, length, beta, recent, inv_temp, staleness, prefill = TBA[task]
    assert (script, gpus, args.vllm_gpu, args.k) == ("tba_vllm.py", 1, 1, k)
    assert (args.per_device_train_batch_size * args.gradient_accumulation_steps, args.total_episodes // batch) == (
        batch, steps) and args.total_episodes % batch == 0
    assert (args.learning_rate, args.response_length, args.max_prompt_length, args.temperature) == (lr, length, 512, 0.7)
    assert (args.beta, args.beta_final, args.beta_anneal_updates, args.beta_cut_update) == beta
    assert args.deepspeed_config == "ds_configs/zero2_noclip.json"  # TBA clips no gradient
    assert (args.recent_prob, args.inv_temp, args.buffer_size, args.off_policy_steps, args.buffer_prefill) == (
        recent, inv_temp, 100, staleness, prefill)
    if task == "tldr":  # TRL's non_eos_penalty: -1 in place of the score
        assert (args.missing_eos_mode, args.missing_eos_penalty, args.sft_model_path) == (
            "replace", -1.0, "mnoukhov/pythia1b-sft-tldr")
    else:
        assert (args.missing_eos_penalty, args.rule_reward, args.sft_model_path) == (
            0.0, "last_number", "realtreetune/rho-1b-sft-GSM8K")
    _, _, eval_args = _parsed(evaluation)
    assert eval_args.response_length == length


def test_gsm8k_no_robots_and_tba_refuse_what_they_cannot_run():
    for script, arguments in (("gsm8k.sh", ["bok", "async"]), ("gsm8k.sh", ["rloo", "fast"]),
                              ("no_robots.sh", ["fast"]), ("tba.sh", ["tldr", "7b"]), ("tba.sh", ["math"])):
        result = run(["bash", f"benchmark/{script}", "--print", *arguments], check=False)
        assert result.returncode == 2 and result.stderr.startswith("error:"), arguments
