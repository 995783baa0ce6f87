"""Online DPO: direct preference optimisation on pairs the policy samples and a reward model ranks.

For every prompt the policy samples k responses; a reward model scores them; the highest-scoring
response is "chosen" and the lowest "rejected". The loss is DPO's (Rafailov et al. 2023) on the
sequence log-probability margin relative to the frozen SFT reference,
    margin = (log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected)),
either -log sigmoid(beta * margin) or IPO's (margin - 1 / (2 beta))^2 (Azar et al. 2023). Being
online (Guo et al. 2024), the pairs come from the current policy. `num_mini_batches` is the
off-policy knob of Noukhovitch et al. 2025 ("Asynchronous RLHF", arXiv 2410.18252): with N
mini-batches, one generation round feeds N updates, so later updates learn from older samples;
online DPO is the method that paper finds most robust to it.

    python online_dpo.py                               # the offline tiny task, on a CPU
    python online_dpo.py --help                        # every argument
    deepspeed --num_gpus 4 online_dpo.py --deepspeed-config ds_configs/zero3.json \\
        --sft-model-path ... --reward-model-path ... --dataset-name ...
"""

import contextlib
import json
import math
import os
import re
import shutil
import socket
import sys
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import deepspeed
import torch.distributed as dist
import torch.nn.functional as F
import tyro
from datasets import load_dataset
from datasets.exceptions import DatasetGenerationError
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from tqdm import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer, StaticCache)


@dataclass
class Args:
    exp_name: str = os.path.basename(__file__)[: -len(".py")]
    """name of this experiment, the first part of the run name"""
    seed: int = 1
    """random seed"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to log without a network)"""
    wandb_project_name: str = "async-rlhf"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user)"""
    output_dir: str = "runs"
    """each run writes metrics.jsonl and checkpoints to <output_dir>/<run name>/"""

    sft_model_path: str = "assets/tiny/sft"
    """policy and reference model: a local directory or a hub id"""
    reward_model_path: Optional[str] = "assets/tiny/reward"
    """reward model (AutoModelForSequenceClassification with one label) used for training; not loaded with --rule-reward"""
    gold_reward_model_path: Optional[str] = "assets/tiny/gold_reward"
    """optional reward model used only for evaluation (eval/gold_scores); None to skip; not loaded with --rule-reward"""
    rule_reward: Optional[str] = None
    """score with a rule instead of a reward model: `last_number` (GSM8K's: 1 if the response's last number is the answer, else 0)"""
    answer_column: str = "answer"
    """with --rule-reward: the dataset column holding each prompt's answer"""
    trust_remote_code: bool = False
    """allow models and tokenizers to run code from their repository"""
    dataset_name: str = "assets/tiny/data"
    """dataset whose prompts are a `query` column of text or a `messages` column of chats: a local directory or a hub id"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_eval_split: str = "test"
    """split to evaluate on"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens keep their last max_prompt_length tokens"""
    response_length: int = 16
    """number of tokens to sample for each response"""
    temperature: float = 0.7
    """sampling temperature; training log-probabilities use the same temperature"""
    stop_token: str = "eos"
    """a response ends at its first stop token: `eos` for the tokenizer's EOS, or a string that is one token"""
    missing_eos_penalty: float = -1.0
    """score penalty for a response that has no stop token (see --missing-eos-mode)"""
    missing_eos_mode: str = "add"
    """`add` the penalty to the score of a response without a stop token (TRL), or `replace` its score by it (the paper's code)"""

    total_episodes: int = 64_000
    """number of sampled responses to train on"""
    learning_rate: float = 2e-5
    """AdamW learning rate, decayed linearly to zero"""
    per_device_train_batch_size: int = 64
    """responses per forward/backward pass on each device"""
    gradient_accumulation_steps: int = 1
    """micro-batches per optimizer step"""
    num_mini_batches: int = 1
    """optimizer steps per generation batch (the off-policy knob)"""
    num_ppo_epochs: int = 1
    """passes over each generation batch"""
    k: int = 2
    """responses sampled per prompt"""
    beta: float = 0.1
    """strength of the implicit KL constraint to the reference (DPO's beta)"""
    loss_type: str = "sigmoid"
    """`sigmoid` (DPO) or `ipo` (IPO)"""

    deepspeed_config: str = "ds_configs/zero2.json"
    """DeepSpeed JSON config (ZeRO stage, offload); batch sizes and precision are filled in here"""
    bf16: bool = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    """train and generate in bfloat16 (default: on when the GPU has it natively, compute capability 8.0 or later)"""
    gradient_checkpointing: bool = False
    """recompute activations in the backward pass to save memory"""
    eval_every: int = 20
    """evaluate every this many updates (0: only at the end)"""
    num_eval_prompts: int = 256
    """held-out prompts for evaluation (greedy responses, proxy and gold scores)"""
    save_every: int = 0
    """save a checkpoint every this many updates (0: only at the end)"""
    resume: Optional[str] = None
    """checkpoint directory, or run directory (its latest checkpoint), to continue from"""
    local_rank: int = 0
    """set by the deepspeed launcher"""

    # Filled in at run time.
    world_size: int = 1
    """(set at run time) number of processes"""
    local_batch_size: int = 0
    """(set at run time) responses per generation batch on each device"""
    batch_size: int = 0
    """(set at run time) responses per generation batch on all devices"""
    num_updates: int = 0
    """(set at run time) number of generation batches"""


# ===========================================================================================================
# The algorithm: the only functions that differ between the algorithm scripts. To try a new loss,
# change these and steps 3-4 of the loop in main(), which follows them.
# ===========================================================================================================

def select_pairs(scores, k):
    """Indices of the chosen (highest score) and rejected (lowest score) response of each prompt.

    `scores` holds k blocks of the same prompts: index j * num_prompts + i is sample j of prompt i.
    Equal scores go to the first of those samples (argmax and argmin return the first index), so a
    prompt whose k scores are all equal is paired with itself: its margin is exactly zero and it
    adds no gradient."""
    scores = scores.view(k, -1)
    num_prompts = scores.shape[1]
    prompts = torch.arange(num_prompts, device=scores.device)
    return scores.argmax(0) * num_prompts + prompts, scores.argmin(0) * num_prompts + prompts


def dpo_loss(chosen_logratios, rejected_logratios, beta, loss_type):
    """Mean DPO or IPO loss over pairs; the log-ratios are sequence sums of log pi - log ref."""
    margin = chosen_logratios - rejected_logratios
    if loss_type == "sigmoid":
        losses = -F.logsigmoid(beta * margin)
    else:
        losses = (margin - 1 / (2 * beta)) ** 2
    return losses.mean()


def main(args):
    """The run: set-up (distributed, data, models and their DeepSpeed engines, the run directory), then the loop,
    whose numbered steps are the algorithm."""
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args)
    rank, device = set_up_distributed(args)
    prompts_per_rank = args.local_batch_size // args.k
    tokenizer, stop_id, train_prompts, eval_prompts, train_answers, eval_answers = load_data(args, prompts_per_rank)
    run_name, run_dir = run_directory(args)

    # Models and DeepSpeed engines: the policy trains; the reference and reward models only run forward.
    policy = training_engine(args, load_model(args, args.sft_model_path))
    ref_policy = frozen_engine(args, load_model(args, args.sft_model_path))
    reward_model = frozen_engine(args, load_model(args, args.reward_model_path, reward=True))
    gold_model = frozen_engine(args, load_model(args, args.gold_reward_model_path, reward=True))

    start_update, episode = 0, 0
    if args.resume:
        start_update, episode = load_checkpoint(latest_checkpoint(args.resume), {"policy": policy})

    run_log = RunLog(args, run_dir, run_name, start_update)  # metrics.jsonl (rank 0), wandb with --track
    if rank == 0:
        print(f"run {run_dir}: {args.num_updates} updates of {args.batch_size} responses "
              f"({args.batch_size // args.k} prompts x {args.k})", flush=True)

    pad = tokenizer.pad_token_id
    progress = tqdm(total=args.num_updates * args.batch_size, initial=episode, unit="ep", disable=rank != 0)
    if not args.resume:  # the curves start from the SFT policy
        eval_metrics, samples = evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer,
                                         stop_id, device)
        run_log.log(0, {**eval_metrics, "episode": 0}, samples)
    start_time, start_episode = time.time(), episode
    for update in range(start_update + 1, args.num_updates + 1):
        # 1. Generate k responses per prompt with the current policy.
        t0 = time.time()
        indices = prompt_batch(len(train_prompts), prompts_per_rank, update - 1, args.seed, rank, args.world_size)
        queries = left_pad([train_prompts[i] for i in indices], pad, device).repeat(args.k, 1)
        answers = [train_answers[i] for i in indices] * args.k  # the k blocks of queries
        context_length = queries.shape[1]
        with unwrapped_for_generation(policy) as model:
            responses = generate(model, queries, pad, stop_id, args.response_length, args.temperature)
        responses = truncate_response(responses, stop_id, pad)
        query_responses = torch.cat([queries, responses], 1)
        padding_mask = responses == pad  # everything after the response
        t1 = time.time()

        # 2. Score: log-probabilities under the reference and reward-model scores. The policy's log-probabilities
        #    come from the training forward in step 4 (DPO's loss needs no others), and so does the logged KL.
        ref_logprobs, scores = [], []
        with torch.no_grad():
            for i in range(0, len(query_responses), args.per_device_train_batch_size):
                chunk = query_responses[i: i + args.per_device_train_batch_size]
                ref_logprobs.append(response_logprobs(forward(ref_policy, chunk, pad).logits, chunk[:, context_length:],
                                                      context_length, args.temperature))
                scores.append(score_responses(args, reward_model, chunk, context_length,
                                              answers[i: i + args.per_device_train_batch_size], tokenizer))
        ref_logprobs = torch.cat(ref_logprobs).masked_fill(padding_mask, 0.0)
        raw_scores = torch.cat(scores)
        scores = apply_missing_eos_penalty(raw_scores, responses, stop_id, args.missing_eos_penalty,
                                           args.missing_eos_mode)

        # 3. Pairs: the best and the worst response to each prompt.
        chosen, rejected = select_pairs(scores, args.k)
        t2 = time.time()

        # 4. DPO updates over mini-batches of the prompts; each micro-batch holds whole prompts.
        stats = {name: [] for name in ("loss", "chosen_logps", "rejected_logps", "chosen_rewards", "rejected_rewards",
                                       "accuracy", "entropy", "kl", "logps", "scores")}
        num_prompts = args.local_batch_size // args.k
        mini_batch_prompts = num_prompts // args.num_mini_batches
        micro_batch_prompts = args.per_device_train_batch_size // args.k
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(num_prompts, device=device)
            for mb_start in range(0, num_prompts, mini_batch_prompts):
                for mc_start in range(mb_start, mb_start + mini_batch_prompts, micro_batch_prompts):
                    prompts = order[mc_start: mc_start + micro_batch_prompts]
                    idx = torch.cat([chosen[prompts], rejected[prompts]])  # chosen first, then rejected
                    logits = forward(policy, query_responses[idx], pad).logits
                    new_logprobs = response_logprobs(logits, responses[idx], context_length, args.temperature)
                    new_logprobs = new_logprobs.masked_fill(padding_mask[idx], 0.0).sum(1)
                    new_logratios = new_logprobs - ref_logprobs[idx].sum(1)
                    chosen_logratios, rejected_logratios = new_logratios.chunk(2)
                    loss = dpo_loss(chosen_logratios, rejected_logratios, args.beta, args.loss_type)
                    policy.backward(loss)
                    policy.step()
                    with torch.no_grad():
                        entropy = entropy_from_logits(logits[:, context_length - 1: -1] / args.temperature)
                        stats["loss"].append(loss)
                        stats["chosen_logps"].append(new_logprobs.chunk(2)[0].mean())
                        stats["rejected_logps"].append(new_logprobs.chunk(2)[1].mean())
                        stats["chosen_rewards"].append(args.beta * chosen_logratios.mean())
                        stats["rejected_rewards"].append(args.beta * rejected_logratios.mean())
                        stats["accuracy"].append((chosen_logratios > rejected_logratios).float().mean())
                        stats["entropy"].append(masked_mean(entropy, ~padding_mask[idx]))
                        stats["kl"].append(new_logratios.mean())
                        stats["logps"].append(new_logprobs.mean())
                        stats["scores"].append(scores[idx].mean())
        logits = None  # batch x length x vocabulary: not held through the steps that follow
        get_accelerator().synchronize()  # a GPU may still run the optimizer's step: it counts as training
        t3 = time.time()

        # 5. Log, evaluate, save.
        episode += args.batch_size
        progress.update(args.batch_size)
        step_means = {name: torch.stack(per_step).mean().item() for name, per_step in stats.items()}
        metrics = mean_over_ranks({
            "objective/scores": scores.mean().item(),
            "objective/raw_scores": raw_scores.mean().item(),
            "objective/scores_margin": (scores[chosen] - scores[rejected]).mean().item(),
            # pairs/*: the chosen and rejected responses (every response when k = 2 and no scores tie), as the
            # training forward sees them: under the policy being trained, not (off-policy) the one that sampled them.
            "pairs/scores": step_means["scores"],
            "pairs/kl": step_means["kl"],
            "pairs/non_score_reward": -args.beta * step_means["kl"],
            "pairs/rlhf_reward": step_means["scores"] - args.beta * step_means["kl"],
            "pairs/entropy": -step_means["logps"],
            "policy/entropy_avg": step_means["entropy"],
            "loss/policy_avg": step_means["loss"],
            "logps/chosen": step_means["chosen_logps"],
            "logps/rejected": step_means["rejected_logps"],
            "rewards/chosen": step_means["chosen_rewards"],
            "rewards/rejected": step_means["rejected_rewards"],
            "rewards/margins": step_means["chosen_rewards"] - step_means["rejected_rewards"],
            "rewards/accuracies": step_means["accuracy"],
            "val/num_eos_tokens": (responses == stop_id).sum().item() * args.world_size,
            "val/response_length": (~padding_mask).sum(1).float().mean().item(),
            "time/generation": t1 - t0,
            "time/scoring": t2 - t1,
            "time/training": t3 - t2,
        }, device)
        metrics.update({"lr": policy.get_lr()[0], "episode": episode,
                        "time/episodes_per_second": (episode - start_episode) / (time.time() - start_time)})
        samples = None
        if (args.eval_every and update % args.eval_every == 0) or update == args.num_updates:
            eval_metrics, samples = evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer,
                                             stop_id, device)
            metrics.update(eval_metrics)
            if rank == 0:
                tqdm.write(f"update {update}: " + ", ".join(f"{k} {v:.3f}" for k, v in eval_metrics.items()))
                for query, response, score in samples[:2]:
                    tqdm.write(f"  {query!r} -> {response!r} (score {score})")
        run_log.log(update, metrics, samples)
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['pairs/kl']:.2f}",
                             eps=f"{metrics['time/episodes_per_second']:.0f}")
        if (args.save_every and update % args.save_every == 0) or update == args.num_updates:
            save_checkpoint(args, run_dir, update, episode, {"policy": policy})

    progress.close()
    run_log.close()
    dist.barrier()
    dist.destroy_process_group()


# ===========================================================================================================
# Appendix: argument checks (validate, each script's own), then the plumbing, the same in every script that has it
# (data, generation, scoring, evaluation, checkpoints, set-up; tests/test_shared_helpers.py: change one, change all).
# ===========================================================================================================

def validate(args):
    """Check the arguments before any model is loaded; fill in the derived batch sizes."""
    check_gpu_driver()
    check_bounds(args, positive=("beta",))
    if args.k < 2:
        fail("k", f"a pair needs at least 2 responses per prompt, got {args.k}")
    if args.per_device_train_batch_size % args.k:
        fail("k", f"must divide --per-device-train-batch-size ({args.per_device_train_batch_size}): "
                  "a micro-batch holds whole prompts")
    if args.loss_type not in ("sigmoid", "ipo"):
        fail("loss_type", f"must be sigmoid or ipo, got {args.loss_type!r}")
    if args.missing_eos_mode not in ("add", "replace"):
        fail("missing_eos_mode", f"must be add or replace, got {args.missing_eos_mode!r}")
    if args.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        fail("bf16", "this GPU has no native bfloat16 (compute capability 8.0 or later: A100, H100, L4, RTX 30xx); "
                     "train in float32 with --no-bf16")
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    args.batch_size = args.local_batch_size * args.world_size
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1:
        fail("total_episodes", f"must be at least one batch of {args.batch_size} responses")
    check_files(args)
    check_numbers(args)
    check_model(args, "sft_model_path")
    check_rewards(args)
    check_resume(args)
    config = AutoConfig.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.max_prompt_length + args.response_length > positions:
        fail("response_length", f"max_prompt_length + response_length = {args.max_prompt_length + args.response_length}"
                                f" exceeds the model's {positions} positions")


def fail(argument, message):
    """Bad input: one line on stderr naming the argument, exit code 2."""
    print(f"error: --{argument.replace('_', '-')}: {message}", file=sys.stderr)
    sys.exit(2)


def check_gpu_driver():
    """Stop (one line, exit code 2) when this machine has NVIDIA GPUs that this torch cannot use: a CUDA build of
    torch under a driver older than it needs finds no GPU, and the run would go on on the CPU without a word."""
    if torch.version.cuda is None or torch.cuda.is_available():
        return
    try:
        import pynvml

        pynvml.nvmlInit()
        gpus, driver = pynvml.nvmlDeviceGetCount(), pynvml.nvmlSystemGetDriverVersion()
    except Exception:  # no NVIDIA driver (or no NVML): a machine without NVIDIA GPUs
        return
    if gpus:
        needed = {"12": "R525", "13": "R580"}.get(torch.version.cuda.split(".")[0], "a newer one")
        print(f"error: this torch is a CUDA {torch.version.cuda} build, which needs NVIDIA driver {needed} or newer; "
              f"this machine's {gpus} GPU(s) have driver {driver}, so CUDA is unavailable (update the driver, or "
              "install a torch built for an older CUDA: README, GPUs)", file=sys.stderr)
        sys.exit(2)


def check_model_path(argument, path):
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if os.path.isfile(path):
        fail(argument, f"{path} is a file, not a directory")
    if not os.path.isdir(path) and not looks_like_hub_id:
        fail(argument, f"no such directory: {path}")


def check_model(args, argument, reward=False):
    """A model argument, before anything loads: a directory (a hub id is checked when it loads) with a readable config
    and a tokenizer; a reward model is a sequence classifier (any other gets a random score head), a policy is not."""
    path = getattr(args, argument)
    check_model_path(argument, path)
    if not os.path.isdir(path):
        return
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=args.trust_remote_code)
    except (OSError, ValueError) as error:
        fail(argument, f"cannot read the model's config in {path}: {str(error).splitlines()[0]}")
    tokenizer_files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.isfile(os.path.join(path, name)) for name in tokenizer_files):
        fail(argument, f"{path} has no tokenizer")
    classifier = any(name.endswith("ForSequenceClassification") for name in config.architectures or [])
    if reward and not classifier:
        fail(argument, f"{path} is not a reward model: its architectures are {config.architectures}, "
                       "not a ...ForSequenceClassification")
    if not reward and classifier:  # it would load as a language model with an untrained output layer
        fail(argument, f"{path} is a reward model ({config.architectures[0]}), not a language model")


def check_rewards(args):
    """A reward model (and an optional gold one), or with --rule-reward a known rule and no reward models."""
    if args.rule_reward is not None:
        if args.rule_reward not in RULE_REWARDS:
            fail("rule_reward", f"must be one of {sorted(RULE_REWARDS)}, got {args.rule_reward!r}")
        args.reward_model_path = args.gold_reward_model_path = None  # the rule scores; no model is loaded
        return
    if args.reward_model_path is None:
        fail("reward_model_path", "required unless --rule-reward names a rule")
    check_model(args, "reward_model_path", reward=True)
    if args.gold_reward_model_path is not None:
        check_model(args, "gold_reward_model_path", reward=True)


def check_bounds(args, positive=(), at_least_0=()):
    """Number arguments within their bounds: the batch sizes, lengths and counts of every script at least 1, its
    temperature and learning rate positive, its evaluation and save intervals 0 or more, and the script's own."""
    at_least_1 = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
                  "response_length", "max_prompt_length", "total_episodes", "num_eval_prompts")
    for names, low, strict in ((at_least_1, 1, False), (positive + ("temperature", "learning_rate"), 0, True),
                               (at_least_0 + ("eval_every", "save_every"), 0, False)):
        for name in names:
            value = getattr(args, name)
            if value < low or (strict and value == low):
                fail(name, f"must be {'positive' if strict else f'at least {low}'}, got {value}")


def check_numbers(args):
    """Every number argument is finite and the seed one that every generator takes."""
    for name, value in asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(name, f"must be a finite number, got {value}")
    if not 0 <= args.seed < 2**31:  # vLLM's per-batch seeds are seed * 2**32 + an offset: under 2**64
        fail("seed", f"must be in [0, 2**31), got {args.seed}")


def check_files(args):
    """--deepspeed-config is a JSON file with a ZeRO stage; --output-dir is not a file."""
    if not os.path.isfile(args.deepspeed_config):
        fail("deepspeed_config", f"no such file: {args.deepspeed_config}")
    try:
        with open(args.deepspeed_config) as f:
            config = json.load(f)
    except ValueError as error:
        fail("deepspeed_config", f"{args.deepspeed_config} is not valid JSON: {error}")
    if not isinstance(config, dict) or not isinstance(config.get("zero_optimization"), dict) \
            or "stage" not in config["zero_optimization"]:
        fail("deepspeed_config", f"{args.deepspeed_config} has no zero_optimization.stage")
    if os.path.isfile(args.output_dir):
        fail("output_dir", f"{args.output_dir} is a file, not a directory")


RESUME_KEEPS = ("seed", "dataset_name", "dataset_train_split", "max_prompt_length", "response_length", "k",
                "per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "total_episodes",
                "world_size", "off_policy_steps", "sync", "bf16")  # (bf16: DeepSpeed names its state files by it)


def check_resume(args):
    """--resume names a run or checkpoint directory of this script, written with this run's RESUME_KEEPS: the
    arguments that decide which prompts each update takes, how its batches are made and sampled, and (in *_vllm.py)
    how stale they are, so that the resumed run repeats the stopped one. Others (logging, evaluation) may change."""
    if args.resume is None:
        return
    if not os.path.isdir(args.resume):
        fail("resume", f"no such directory: {args.resume}")
    path = os.path.join(latest_checkpoint(args.resume), "trainer_state.json")
    try:
        with open(path) as f:
            state = json.load(f)
        script, saved = state.get("script"), state.get("args", {})
    except (OSError, ValueError, AttributeError) as error:
        fail("resume", f"cannot read {path}: {error}")
    if script not in (None, os.path.basename(__file__)):
        fail("resume", f"{args.resume} holds a checkpoint of {script}, not of {os.path.basename(__file__)}")
    for name in RESUME_KEEPS:
        if name in saved and hasattr(args, name) and getattr(args, name) != saved[name]:
            what = "processes" if name == "world_size" else f"as --{name.replace('_', '-')}"
            fail("resume", f"{path} was written with {saved[name]} {what}, this run has {getattr(args, name)}: "
                           "a resumed run must keep it")


def read_dataset(args):
    """--dataset-name through datasets' load_dataset (a directory of JSON lines or parquet files, or a hub id). Every
    way it can fail is bad input: one line naming the argument, exit code 2."""
    if not os.path.exists(args.dataset_name) and args.dataset_name.count("/") != 1:
        fail("dataset_name", f"no such directory: {args.dataset_name}")
    try:
        return load_dataset(args.dataset_name)
    except StopIteration:  # what datasets' JSON loader raises on an empty file
        files = sorted(os.listdir(args.dataset_name)) if os.path.isdir(args.dataset_name) else []
        empty = [f for f in files if os.path.getsize(os.path.join(args.dataset_name, f)) == 0]
        fail("dataset_name", f"cannot load {args.dataset_name}: {', '.join(empty) or 'a data file'} is empty")
    except (OSError, ValueError, DatasetGenerationError) as error:  # unreadable, a line that is not JSON, ...
        cause = str(error.__cause__ or error).strip() or type(error).__name__
        fail("dataset_name", f"cannot load {args.dataset_name}: {cause.splitlines()[0]}")


def load_prompts(args, tokenizer):
    """Token ids of the train and eval splits' prompts and, with --rule-reward, their answers (else Nones). A prompt is
    the `query` column's text, or the `messages` column's chat in the tokenizer's chat template with the generation
    prompt (a last assistant turn, the reference reply as in No Robots, is left out)."""
    dataset = read_dataset(args)
    prompts, answers = {}, {}
    for argument in ("dataset_train_split", "dataset_eval_split"):
        split = getattr(args, argument)
        if split not in dataset:
            fail(argument, f"dataset {args.dataset_name} has no split {split!r} (it has {sorted(dataset)})")
        columns = dataset[split].column_names
        if "query" not in columns and "messages" not in columns:
            fail("dataset_name", f"split {split!r} has no `query` or `messages` column (it has {columns})")
        if args.rule_reward is not None and args.answer_column not in columns:
            fail("answer_column", f"split {split!r} of {args.dataset_name} has no {args.answer_column!r} column "
                                  f"(it has {columns})")
        if len(dataset[split]) == 0:
            fail(argument, f"split {split!r} of {args.dataset_name} is empty")
        if "query" in columns:
            texts = list(dataset[split]["query"])
        elif tokenizer.chat_template is None:
            fail("dataset_name", f"split {split!r} holds `messages` but the tokenizer of {args.sft_model_path} "
                                 "has no chat template")
        else:
            texts = [tokenizer.apply_chat_template(chat[:-1] if chat[-1]["role"] == "assistant" else chat,
                                                   tokenize=False, add_generation_prompt=True)
                     for chat in dataset[split]["messages"]]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]  # a template's BOS is in its text
        prompts[argument] = [q[-args.max_prompt_length:] for q in ids]
        answers[argument] = ([str(a) for a in dataset[split][args.answer_column]] if args.rule_reward is not None
                             else [None] * len(ids))
    return (prompts["dataset_train_split"], prompts["dataset_eval_split"], answers["dataset_train_split"],
            answers["dataset_eval_split"])


def load_tokenizer(path, trust_remote_code):
    """A tokenizer whose pad token is used for nothing else: padding is found by comparing token ids with it. Where
    there is none (Pythia) or it is EOS (SmolLM2, Qwen2.5, Llama 3: every EOS, also a chat template's `<|im_end|>`,
    would be masked as padding), `[PAD]` is added, to this tokenizer only. Its id may lie past the vocabulary: no
    model reads it (forward() and generate() give padded positions token 0 under a zero attention mask), the
    embeddings are not resized, so the learner's softmax is vLLM's and checkpoints keep the model's own vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def stop_token_id(args, tokenizer):
    if args.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            fail("stop_token", "the tokenizer has no EOS token; name a stop token")
        return tokenizer.eos_token_id
    ids = tokenizer.encode(args.stop_token, add_special_tokens=False)
    if len(ids) != 1:
        fail("stop_token", f"{args.stop_token!r} is not a single token of the tokenizer (it is {len(ids)} tokens)")
    return ids[0]


def prompt_batch(num_prompts, per_rank, update, seed, rank, world_size):
    """This rank's prompt indices for generation batch `update`: shuffled epochs, no repeats within one."""
    per_batch = per_rank * world_size
    batches_per_epoch = num_prompts // per_batch
    epoch, position = divmod(update, batches_per_epoch)
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    start = position * per_batch + rank * per_rank
    return order[start: start + per_rank]


def left_pad(sequences, pad_token_id, device):
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


@torch.no_grad()
def generate(model, queries, pad_token_id, stop_token_id, response_length, temperature=None):
    """Sample (or, with temperature None, greedily decode) responses to left-padded queries: HF generate()'s loop (the
    same tokens for the same seed) with a preallocated KV cache and without its per-step machinery (logits processors,
    stopping criteria), which costs more than a small model's arithmetic. After its stop token a response gets
    padding; the loop ends when all have one. Padded positions read token 0 (see load_tokenizer)."""
    attention_mask = queries != pad_token_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    cache = StaticCache(config=model.config, max_cache_len=queries.shape[1] + response_length)
    cache_position = torch.arange(queries.shape[1], device=queries.device)
    finished = torch.zeros(len(queries), dtype=torch.bool, device=queries.device)
    inputs, tokens = queries.masked_fill(~attention_mask, 0), []
    for _ in range(response_length):
        logits = model(input_ids=inputs, attention_mask=attention_mask, position_ids=position_ids,
                       past_key_values=cache, cache_position=cache_position, use_cache=True,
                       logits_to_keep=1).logits[:, -1].float()
        if temperature:
            token = torch.multinomial(torch.softmax(logits / temperature, dim=-1), num_samples=1).squeeze(1)
        else:
            token = logits.argmax(-1)
        token = token.masked_fill(finished, pad_token_id)
        tokens.append(token)
        finished |= token == stop_token_id
        if finished.all():
            break
        inputs = token.masked_fill(finished, 0).unsqueeze(1)  # a finished response's next input: never attended to
        attention_mask = torch.cat([attention_mask, torch.ones_like(inputs, dtype=torch.bool)], 1)
        position_ids = position_ids[:, -1:] + 1
        cache_position = cache_position[-1:] + 1
    return torch.stack(tokens, 1)


def truncate_response(responses, stop_token_id, pad_token_id):
    """Replace everything after the first stop token (which stays), and from the first pad token, by padding."""
    is_stop = responses == stop_token_id
    after_stop = (is_stop.cumsum(1) - is_stop.long()) > 0
    from_pad = (responses == pad_token_id).cumsum(1) > 0
    return responses.masked_fill(after_stop | from_pad, pad_token_id)


def forward(model, query_responses, pad_token_id):
    """Run a model on left-padded queries followed by right-padded responses; padded positions are masked and read
    token 0 (the pad id may lie outside the model's vocabulary, see load_tokenizer)."""
    attention_mask = query_responses != pad_token_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=query_responses.masked_fill(~attention_mask, 0), attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=False)


def response_logprobs(logits, responses, context_length, temperature):
    """Log-probabilities of the response tokens under logits divided by the sampling temperature. Padding gets a
    number that callers mask: its id may lie past the vocabulary (load_tokenizer), so it reads the last row."""
    logits = logits[:, context_length - 1: -1].float() / temperature
    tokens = responses.clamp(max=logits.shape[-1] - 1)
    return torch.log_softmax(logits, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits):
    logits = logits.float()
    return torch.logsumexp(logits, -1) - (torch.softmax(logits, -1) * logits).sum(-1)


@torch.no_grad()
def reward_scores(model, query_responses, pad_token_id):
    """One score per sequence: the classifier's head (`score`) on the hidden state of its last non-pad token, found
    here rather than by the model, which would look for its config's pad id (EOS, for many tokenizers)."""
    module = getattr(model, "module", model)  # a DeepSpeed engine's model
    hidden = forward(getattr(module, module.base_model_prefix), query_responses, pad_token_id).last_hidden_state
    positions = torch.arange(query_responses.shape[1], device=query_responses.device)
    last = ((query_responses != pad_token_id) * positions).argmax(1)
    return module.score(hidden[torch.arange(len(hidden), device=hidden.device), last]).squeeze(-1).float()


def last_number_reward(response, answer):
    """GSM8K's rule: 1.0 when the last number in the response equals the last number of the answer (of the
    text after `####` in GSM8K's answer column), else 0.0; commas in numbers are ignored."""
    numbers = [re.findall(r"-?\d[\d,]*(?:\.\d+)?", text) for text in (response, answer.split("####")[-1])]
    if not numbers[0] or not numbers[1]:
        return 0.0
    return float(float(numbers[0][-1].replace(",", "")) == float(numbers[1][-1].replace(",", "")))


RULE_REWARDS = {"last_number": last_number_reward}  # the rules --rule-reward names; add yours here


@torch.no_grad()
def score_responses(args, reward_model, query_responses, context_length, answers, tokenizer):
    """One score per response: the reward model's, or the --rule-reward rule's on the response's text and answer."""
    if args.rule_reward is None:
        return reward_scores(reward_model, query_responses, tokenizer.pad_token_id)
    texts = tokenizer.batch_decode(query_responses[:, context_length:], skip_special_tokens=True)
    rule = RULE_REWARDS[args.rule_reward]
    return torch.tensor([rule(text, answer) for text, answer in zip(texts, answers)], device=query_responses.device)


def apply_missing_eos_penalty(scores, responses, stop_token_id, penalty, mode):
    """The score of a response without a stop token: `add` the penalty to it (TRL), or `replace` it by the
    penalty (the paper's code)."""
    missing = ~(responses == stop_token_id).any(1)
    if mode == "replace":
        return torch.where(missing, torch.full_like(scores, penalty), scores)
    return scores + penalty * missing.float()


def masked_mean(values, mask):
    return (values * mask).sum() / mask.sum().clamp(min=1)


def mean_over_ranks(stats, device):
    """Average a dict of floats over all processes (on the device: NCCL reduces only CUDA tensors)."""
    values = torch.tensor(list(stats.values()), dtype=torch.float64, device=device)
    dist.all_reduce(values)
    return dict(zip(stats, (values / dist.get_world_size()).tolist()))


@contextlib.contextmanager
def unwrapped_for_generation(engine):
    """The policy module for generate(), in eval mode (under --gradient-checkpointing it trains in training mode, where
    transformers drops the KV cache); under ZeRO-3 its parameters are gathered once for the whole call (DeepSpeed's
    helper), not layer by layer at every decoding step."""
    training = engine.module.training
    engine.module.eval()
    try:
        with unwrap_model_for_generation(engine) if engine.zero_optimization_stage() == 3 else contextlib.nullcontext():
            yield engine.module
    finally:
        engine.module.train(training)


@torch.no_grad()
def evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer, stop_id, device):
    """Greedy responses to held-out prompts, scored by the reward model (and the gold model) or the rule (with
    `last_number`, eval/scores is the accuracy)."""
    rank, world, size = dist.get_rank(), dist.get_world_size(), args.per_device_train_batch_size
    total = min(args.num_eval_prompts, len(eval_prompts))
    indices = list(range(rank, total, world))
    # Every rank runs as many batches as rank 0 (under ZeRO-3 each forward pass gathers parameters from all ranks):
    # a rank with fewer prompts fills up with the first, counted 0 times.
    counted = torch.tensor([1.0] * len(indices) + [0.0] * (-(-total // world) - len(indices)), device=device)
    indices += [0] * (len(counted) - len(indices))
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # on the device: NCCL reduces only CUDA tensors
    samples = []
    for start in range(0, len(indices), size):
        batch, weight = indices[start: start + size], counted[start: start + size]
        queries = left_pad([eval_prompts[i] for i in batch], tokenizer.pad_token_id, device)
        with unwrapped_for_generation(policy) as model:
            responses = generate(model, queries, tokenizer.pad_token_id, stop_id, args.response_length)
        responses = truncate_response(responses, stop_id, tokenizer.pad_token_id)
        query_responses = torch.cat([queries, responses], 1)
        scores = score_responses(args, reward_model, query_responses, queries.shape[1],
                                 [eval_answers[i] for i in batch], tokenizer)
        gold = reward_scores(gold_model, query_responses, tokenizer.pad_token_id) if gold_model else scores * 0
        lengths = (responses != tokenizer.pad_token_id).sum(1)
        sums += torch.stack([(scores * weight).sum(), (gold * weight).sum(), (lengths * weight).sum(),
                             weight.sum()]).double()
        if not samples:
            samples = [[tokenizer.decode(q, skip_special_tokens=True), tokenizer.decode(r, skip_special_tokens=True),
                        round(s.item(), 3)] for q, r, s in zip(queries[:4], responses[:4], scores[:4])]
    dist.all_reduce(sums)
    metrics = {"eval/scores": sums[0] / sums[3], "eval/response_length": sums[2] / sums[3]}
    if gold_model is not None:
        metrics["eval/gold_scores"] = sums[1] / sums[3]
    return {k: v.item() for k, v in metrics.items()}, samples


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's checkpoint engine, but loading with weights_only=True so that a checkpoint cannot run code."""

    def load(self, path, map_location=None):
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)


def save_checkpoint(args, run_dir, update, episode, engines, extra_files=None):
    """Write <run_dir>/checkpoint-<update>: every trained model as save_pretrained (the policy at the top with the SFT
    model's own tokenizer, others such as PPO's value model in a subdirectory of their name), the training state in
    training_state/ (each engine's DeepSpeed state, every rank's RNG state) and rank 0's `extra_files` ({name: JSON}).
    Written to a temporary directory renamed at the end: an interruption leaves no half-written checkpoint, and a
    failed write (a full disk) removes it and ends the run with one line."""
    final = os.path.join(run_dir, f"checkpoint-{update}")
    tmp = final + ".tmp"
    try:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        for name, engine in engines.items():
            engine.save_checkpoint(os.path.join(tmp, "training_state"), tag=name, save_latest=False)
            state_dict = gathered_state_dict(engine)
            if dist.get_rank() == 0:
                engine.module.save_pretrained(tmp if name == "policy" else os.path.join(tmp, name), state_dict=state_dict)
        torch.save({"torch": torch.get_rng_state(), "accelerator": get_accelerator().get_rng_state(),
                    "device": get_accelerator().device_name()},
                   os.path.join(tmp, "training_state", f"rng_rank{dist.get_rank()}.pt"))
        if dist.get_rank() == 0:
            AutoTokenizer.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code).save_pretrained(tmp)
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"script": os.path.basename(__file__), "update": update, "episode": episode, "args": asdict(args)},
                          f, indent=1)
            for name, content in (extra_files or {}).items():
                with open(os.path.join(tmp, name), "w") as f:
                    json.dump(content, f)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()
    except (OSError, RuntimeError) as error:  # a full disk: torch.save raises RuntimeError, the rest OSError
        free = shutil.disk_usage(run_dir).free / 2**20
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"error: could not write {final} ({str(error).splitlines()[0]}; {free:.1f} MiB free on its disk): "
                 "the partial checkpoint is removed, earlier checkpoints are intact")


def latest_checkpoint(path):
    """`path` if it is a checkpoint, else the checkpoint of `path` with the highest update."""
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path
    updates = [int(d.split("-")[1]) for d in os.listdir(path) if d.startswith("checkpoint-") and d[len("checkpoint-"):].isdigit()]
    if not updates:
        fail("resume", f"no checkpoint in {path}")
    return os.path.join(path, f"checkpoint-{max(updates)}")


def load_checkpoint(checkpoint, engines):
    """Restore the training state written by save_checkpoint into rank 0's `checkpoint` (where nodes share a directory,
    another node's listing of it may lag and name an older one); returns (update, episode)."""
    chosen = [checkpoint]
    dist.broadcast_object_list(chosen, src=0)
    checkpoint = chosen[0]
    for name, engine in engines.items():
        engine.checkpoint_engine = SafeCheckpointEngine()
        engine.load_checkpoint(os.path.join(checkpoint, "training_state"), tag=name)
    rng = torch.load(os.path.join(checkpoint, "training_state", f"rng_rank{dist.get_rank()}.pt"), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if rng.get("device", get_accelerator().device_name()) == get_accelerator().device_name():  # a GPU's fits no CPU
        get_accelerator().set_rng_state(rng["accelerator"])
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    return state["update"], state["episode"]


def process_group_backend(cuda):
    """torch.distributed's backend for each device type. NCCL reduces only CUDA tensors ("No backend type
    associated with device type cpu"), so on GPUs gloo serves the collectives on CPU objects beside it."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def init_distributed():
    """Join the process group; a plain `python` launch is a group of one."""
    if "RANK" not in os.environ:  # a free port, so several single-process runs can share a machine
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend=process_group_backend(torch.cuda.is_available()))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gathered_state_dict(engine):
    """The engine's weights for save_pretrained, in rank 0's CPU memory (None elsewhere). Under ZeRO-3 every rank takes
    part in gathering them one module at a time, so no device ever holds the whole model."""
    module, rank = engine.module, dist.get_rank()
    if engine.zero_optimization_stage() != 3:
        return module.state_dict() if rank == 0 else None
    state, copies = {}, {}
    for prefix, submodule in module.named_modules():
        own = list(submodule.named_parameters(prefix=prefix, recurse=False))
        with deepspeed.zero.GatheredParameters([p for _, p in own]):
            if rank == 0:
                for name, param in own:  # tied weights (one parameter under two names) are copied once
                    state[name] = copies.setdefault(id(param), param.detach().cpu().clone())
    if rank != 0:
        return None
    persistent = module.state_dict().keys()  # keys only: under ZeRO-3 its parameters are empty shards
    state.update({name: buffer.cpu() for name, buffer in module.named_buffers() if name in persistent})
    return state


def ds_config(args, train):
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    config.update(train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
                  gradient_accumulation_steps=args.gradient_accumulation_steps if train else 1,
                  bf16={"enabled": args.bf16})
    if not train:  # frozen models: partitioned under ZeRO-3 (offloaded if its parameters are), else replicated
        zero = config["zero_optimization"]
        config = {k: v for k, v in config.items() if k not in ("zero_optimization", "gradient_clipping")}
        config["zero_optimization"] = {"stage": 0}
        if zero["stage"] == 3:
            config["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"}
    return config


def set_up_distributed(args):
    """Join the process group and take this rank's device; returns (rank, device)."""
    init_distributed()
    rank = dist.get_rank()
    # The local rank: deepspeed's launcher passes --local_rank and sets LOCAL_RANK; torchrun sets LOCAL_RANK only.
    device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", args.local_rank))))
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed + rank)  # each rank samples different responses
    return rank, device


def load_data(args, prompts_per_rank):
    """The tokenizer, the stop token's id, the tokenised train and eval prompts and their answers (Nones without
    --rule-reward), checked (with the reward models' tokenizers) before any model is loaded."""
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)
    stop_id = stop_token_id(args, tokenizer)
    train_prompts, eval_prompts, train_answers, eval_answers = load_prompts(args, tokenizer)
    if len(train_prompts) < prompts_per_rank * args.world_size:
        fail("per_device_train_batch_size", f"a batch needs {prompts_per_rank * args.world_size} prompts; "
                                            f"the train split has {len(train_prompts)}")
    for argument in ("reward_model_path", "gold_reward_model_path"):  # they score the policy's token ids
        path = getattr(args, argument)
        if path and load_tokenizer(path, args.trust_remote_code).get_vocab() != tokenizer.get_vocab():
            fail(argument, f"the tokenizer of {path} differs from the policy's")
    return tokenizer, stop_id, train_prompts, eval_prompts, train_answers, eval_answers


def run_directory(args):
    """(name, directory) of the run: the resumed run's, or <output_dir>/<exp_name>__<seed>__<rank 0's time>."""
    run_dir = os.path.dirname(os.path.abspath(latest_checkpoint(args.resume))) if args.resume else None
    name = [os.path.basename(run_dir) if run_dir else f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    dist.broadcast_object_list(name, src=0)  # every rank uses rank 0's clock
    return name[0], run_dir or os.path.join(os.path.abspath(args.output_dir), name[0])


def load_model(args, path, reward=False):
    """A causal LM or, with `reward`, a one-label sequence classifier (None without a path), with dropout off (it would
    make the log-probabilities of the same tokens disagree) and its own vocabulary (see load_tokenizer)."""
    if path is None:
        return None
    dtype_and_code = dict(dtype=torch.bfloat16 if args.bf16 else torch.float32, trust_remote_code=args.trust_remote_code)
    if reward:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **dtype_and_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **dtype_and_code)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # the attention's own, in training mode
            module.attention_dropout = 0.0
    return model


def training_engine(args, model):
    """A DeepSpeed engine that trains `model` with AdamW (DeepSpeed's CPU Adam when the optimizer is offloaded),
    the learning rate decayed linearly to zero over the run's optimizer steps."""
    if args.gradient_checkpointing:  # transformers checkpoints only in training mode (dropout is off: load_model)
        model.gradient_checkpointing_enable()
        model.train()
    config = ds_config(args, train=True)
    offload = config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none"
    adam = deepspeed.ops.adam.DeepSpeedCPUAdam if offload else torch.optim.AdamW
    optimizer = adam(model.parameters(), lr=args.learning_rate, eps=1e-5, weight_decay=0.0)
    num_steps = args.num_updates * args.num_mini_batches * args.num_ppo_epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / num_steps)
    return deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)[0]


def frozen_engine(args, model):
    """A DeepSpeed engine that only runs `model` forward (partitioned under ZeRO-3); None for None."""
    if model is None:
        return None
    return deepspeed.initialize(model=model.eval(), config=ds_config(args, train=False))[0]


class RunLog:
    """The run's record, written by rank 0: metrics.jsonl in the run directory (on resume, the lines logged
    after the checkpoint are dropped) and, with --track, wandb."""

    def __init__(self, args, run_dir, run_name, start_update):
        self.writer, self.track = dist.get_rank() == 0, args.track
        self.path = os.path.join(run_dir, "metrics.jsonl")
        if not self.writer:
            return
        os.makedirs(run_dir, exist_ok=True)
        if args.resume and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["update"] <= start_update]
            with open(self.path, "w") as f:
                f.writelines(kept)
        if self.track:
            import wandb

            self.wandb = wandb
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name, id=run_name,
                       config=asdict(args), resume="allow" if args.resume else None, save_code=True)

    def log(self, update, metrics, samples=None):
        if not self.writer:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps({"update": update, **metrics}) + "\n")
        if self.track:
            self.wandb.log(metrics, step=metrics["episode"])
            if samples:
                table = self.wandb.Table(columns=["query", "response", "score"], data=samples)
                self.wandb.log({"eval/samples": table}, step=metrics["episode"])

    def close(self):
        if self.writer and self.track:
            self.wandb.finish()


if __name__ == "__main__":
    main(tyro.cli(Args))
