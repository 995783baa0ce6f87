"""Asynchronous PPO: vLLM generates the next batch while the learner trains on this one.

The algorithm is ppo.py's: one response per prompt, per-token KL rewards with the reward model's
score at the last token, a value model initialised from the reward model, GAE advantages (whitened),
clipped policy and value losses. What changes is who generates and when (Noukhovitch et al. 2025,
"Asynchronous RLHF", arXiv 2410.18252): a vLLM engine on rank 0, in its own process and on its own
device, generates batch t+1 with the policy's weights of K updates ago while the learner trains on
batch t; after each update the learner hands its weights to vLLM. `--sync` makes it on-policy.

Off-policy correction: the clipped ratio is taken to the learner's log-probabilities before the update
(the proximal policy), and each token's loss is weighted by min(pi_prox(y_t) / pi_behaviour(y_t), --is-cap),
with vLLM's log-probabilities of its samples (the behaviour policy's): staleness and engine differences.

    python ppo_vllm.py                                 # the offline tiny task, vLLM on a CPU core
    python ppo_vllm.py --sync                          # the same, on-policy
    python ppo_vllm.py --help                          # every argument
    deepspeed --num_gpus 3 ppo_vllm.py --deepspeed-config ds_configs/zero3.json \\
        --sft-model-path ... --reward-model-path ... --dataset-name ...   # vLLM on a 4th GPU
"""

import atexit
import collections
import contextlib
import hashlib
import importlib.metadata
import json
import math
import os
import re
import queue
import shutil
import signal
import socket
import sys
import threading
import time
import unittest.mock
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import deepspeed
import torch.distributed as dist
import tyro
from datasets import load_dataset
from datasets.exceptions import DatasetGenerationError
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation
from tqdm import tqdm
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer, StaticCache)

# vLLM logs about a hundred INFO lines around a run's own (start-up, compilation, shutdown): warnings only unless the
# user sets VLLM_LOGGING_LEVEL (INFO shows them). Read when vLLM is first imported; its engine's processes inherit it.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


@dataclass
class Args:
    """Every argument (vLLM logs warnings only: VLLM_LOGGING_LEVEL=INFO python ... shows its start-up lines)."""

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
    kl_coef: float = 0.05
    """weight of the KL to the reference in the reward"""
    cliprange: float = 0.2
    """clip range of the probability ratio"""
    cliprange_value: float = 0.2
    """clip range of the value update (around the values predicted at generation)"""
    vf_coef: float = 0.1
    """weight of the value loss"""
    gamma: float = 1.0
    """discount factor"""
    lam: float = 0.95
    """GAE lambda"""
    off_policy_steps: int = 1
    """K: each batch is generated by the policy of K updates before the one it trains (the generator runs K ahead)"""
    sync: bool = False
    """on-policy: generate each batch with the newest policy, taking turns with training (for comparison)"""
    vllm_gpu: Optional[int] = None
    """GPU for vLLM, as CUDA_VISIBLE_DEVICES numbers it; default: the next GPU after the training ranks', else rank 0's"""
    vllm_gpu_memory_utilization: Optional[float] = None
    """share of its GPU's memory vLLM may take (default: 0.9 of a GPU of its own, half the free memory of one it shares with training)"""
    vllm_cpu_cores: int = 1
    """without a GPU: CPU cores for vLLM (the learner keeps the others)"""
    vllm_enforce_eager: bool = False
    """skip vLLM's model compilation (and CUDA graphs): starts faster, generates slower; for short runs"""
    generation_timeout: float = 600.0
    """seconds the learner waits for a batch or a weight hand-off before stopping with an error"""
    weight_sync: Optional[str] = None
    """how each new policy reaches vLLM: `memory` (vLLM's weight transfer: NCCL to a GPU of its own, CUDA IPC on one it shares; the default on GPUs) or `file` (a save_pretrained directory, in /dev/shm if it has room, that vLLM reloads; the default on a CPU)"""
    check_weights_every: int = 10
    """check that vLLM holds the learner's weights (log-probabilities of a probe, digests of parameters) when it starts, after the first hand-off and every this many updates; stop with one line if not (0: never)"""
    is_cap: float = 2.0
    """off-policy correction: weight the loss by pi_prox / pi_behaviour, truncated at (or, with --is-mode mask, zero above) this value; 0 turns it off"""
    is_level: str = "token"
    """the importance weight per `token`, per response (`sequence`: the product of its token ratios) or per response as the `geometric` mean of its token ratios (robust on long responses); default RLOO's sequence, PPO's and GRPO's token"""
    is_mode: str = "truncate"
    """`truncate` the weight at --is-cap, or `mask`: a weight above it becomes 0 (the token or response leaves the loss)"""

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

def value_forward(value_model, query_responses, pad_token_id, context_length):
    """Per-token values: the value model's head (`score`: it is a sequence classifier), without its pooling at the last
    token, on the hidden state before each response token. Bypassing the engine's forward, it takes that forward's
    first step: ZeRO-3 counts micro-batches there (else each one's gradient would replace the last one's)."""
    module = value_model.module if isinstance(value_model, deepspeed.DeepSpeedEngine) else value_model
    if hasattr(getattr(value_model, "optimizer", None), "clear_backward_seen_flag"):
        value_model.optimizer.clear_backward_seen_flag()
    hidden = forward(getattr(module, module.base_model_prefix), query_responses, pad_token_id).last_hidden_state
    return module.score(hidden[:, context_length - 1: -1]).squeeze(-1).float()


def token_rewards(scores, logprobs, ref_logprobs, padding_mask, kl_coef):
    """-kl_coef * (logp - logp_ref) at every response token; the score is added at the last one."""
    rewards = (-kl_coef * (logprobs - ref_logprobs)).masked_fill(padding_mask, 0.0)
    last = ((~padding_mask).sum(1) - 1).clamp(min=0)
    rewards[torch.arange(len(rewards), device=rewards.device), last] += scores
    return rewards


def gae_advantages(rewards, values, padding_mask, gamma, lam):
    """Generalised advantage estimation over the response tokens; returns (advantages, returns).

    Rewards and values after the last token are zeroed, so an episode ends at its last token."""
    rewards = rewards.masked_fill(padding_mask, 0.0)
    values = values.masked_fill(padding_mask, 0.0)
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        next_values = values[:, t + 1] if t + 1 < rewards.shape[1] else 0.0
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        running = delta + gamma * lam * running
        advantages[:, t] = running
    return advantages, advantages + values


def masked_whiten(values, mask):
    """Shift to mean 0 and scale to variance 1 over the entries where mask is true."""
    return (values - masked_mean(values, mask)) * torch.rsqrt(masked_var(values, mask) + 1e-8)


def ppo_policy_loss(new_logprobs, old_logprobs, advantages, mask, cliprange, is_weights):
    """Clipped surrogate per token against the proximal policy (`old_logprobs`: the learner's before the update),
    each token's term weighted by its importance weight, averaged over response tokens; returns (loss, log_ratio,
    ratio, clipped)."""
    log_ratio = new_logprobs - old_logprobs
    ratio = torch.exp(log_ratio)
    pg_losses = -advantages * ratio
    pg_losses_clipped = -advantages * torch.clamp(ratio, 1.0 - cliprange, 1.0 + cliprange)
    return (masked_mean(torch.max(pg_losses, pg_losses_clipped) * is_weights, mask), log_ratio, ratio,
            pg_losses_clipped > pg_losses)


def importance_weights(proximal_logprobs, behaviour_logprobs, mask, cap, level, mode):
    """The off-policy correction: constant weights from the ratio pi_prox / pi_behaviour (the learner's policy before
    this update over the version that sampled in vLLM: staleness and engine differences), from per-token
    log-probabilities (B x T, `mask`: response tokens). `level`: per token (B x T), per response as the product of its
    token ratios (`sequence`, B) or as their `geometric` mean (B; small per-token differences, such as bf16's, do not
    compound over a long response). `mode`: `truncate` at the cap, or `mask` (0 above it); all 1 when cap is 0. Also
    returns async/'s statistics: the weights' effective sample size (sum w)^2 / (n sum w^2) as a fraction, their
    mean, the share above the cap (untruncated ratios when off; log-ratios bounded at +-20: no NaN)."""
    log_ratio, valid = ((proximal_logprobs - behaviour_logprobs) * mask).detach(), mask
    if level != "token":
        log_ratio = log_ratio.sum(1) if level == "sequence" else log_ratio.sum(1) / mask.sum(1).clamp(min=1)
        valid = torch.ones_like(log_ratio, dtype=torch.bool)
    ratio = torch.exp(log_ratio)  # may be inf: min(inf, cap) is the cap, and inf > cap is masked
    if cap == 0:
        weights = torch.ones_like(ratio)
    elif mode == "truncate":
        weights = ratio.clamp(max=cap)
    else:
        weights = torch.where(ratio > cap, torch.zeros_like(ratio), ratio)
    w = (weights if cap > 0 else torch.exp(log_ratio.clamp(-20, 20)))[valid]
    stats = {"async/is_ess": (w.sum() ** 2 / (w.numel() * (w ** 2).sum()).clamp(min=1e-30)).item(),
             "async/is_mean": w.mean().item(),
             "async/is_truncated": (ratio[valid] > cap).float().mean().item() if cap > 0 else 0.0}
    return weights, stats


def mismatch_kl(proximal_logprobs, behaviour_logprobs, mask):
    """KL(pi_behaviour || pi_prox) per response token on the behaviour policy's samples: r - 1 - log r with r = pi_prox
    / pi_behaviour (Schulman's k3: unbiased, never negative); log r bounded at 20 (no inf or NaN)."""
    log_r = (proximal_logprobs - behaviour_logprobs).clamp(max=20)
    return masked_mean(torch.exp(log_r) - 1 - log_r, mask).item()


def proximal_mean(values, proximal_logprobs, behaviour_logprobs, mask):
    """The mean of per-response `values` under pi_prox from pi_behaviour's samples: self-normalised weights
    pi_prox(y) / pi_behaviour(y), a softmax of log-ratios. Makes objective/kl the learner's, not an older policy's."""
    log_ratio = ((proximal_logprobs - behaviour_logprobs) * mask).sum(1)
    return (torch.softmax(log_ratio.double(), 0) * values.double()).sum().item()


def ppo_value_loss(new_values, old_values, returns, mask, cliprange_value):
    """Half the clipped squared error to the returns, averaged over response tokens; returns (loss, clipped)."""
    clipped_values = old_values + torch.clamp(new_values - old_values, -cliprange_value, cliprange_value)
    losses = (new_values - returns) ** 2
    losses_clipped = (clipped_values - returns) ** 2
    return 0.5 * masked_mean(torch.max(losses, losses_clipped), mask), losses_clipped > losses


def masked_var(values, mask):
    """Unbiased variance of the entries where mask is true."""
    count = mask.sum()
    return masked_mean((values - masked_mean(values, mask)) ** 2, mask) * count / (count - 1).clamp(min=1)


def explained_variance(values, returns, mask):
    """1 - Var(returns - values) / Var(returns) on response tokens: 1 for exact values, 0 for no better than a mean."""
    return 1 - masked_var(returns - values, mask) / masked_var(returns, mask).clamp(min=1e-8)


def main(args):
    """The run: set-up (distributed, data, models and their DeepSpeed engines, vLLM and its generator thread on rank 0,
    the run directory), then the loop, whose numbered steps are the algorithm."""
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args)
    rank, device = set_up_distributed(args)
    if not torch.cuda.is_available():  # vLLM gets --vllm-cpu-cores of its own; the learner ranks share the others
        torch.set_num_threads(max(1, (len(os.sched_getaffinity(0)) - args.vllm_cpu_cores) // args.world_size))
    prompts_per_rank = args.local_batch_size
    tokenizer, stop_id, train_prompts, eval_prompts, train_answers, eval_answers = load_data(args, prompts_per_rank)
    run_name, run_dir = run_directory(args)

    # Models and DeepSpeed engines: the policy and the value model train (two engines, each with its own AdamW and
    # schedule); the reference and reward models only run forward. The value model starts from the reward model or,
    # with --rule-reward, from the SFT policy under a score head of zeros (a random one adds noise to every advantage).
    policy = training_engine(args, load_model(args, args.sft_model_path))
    value_model = load_model(args, args.reward_model_path or args.sft_model_path, reward=True)
    if args.reward_model_path is None:
        torch.nn.init.zeros_(value_model.score.weight)
    value_model = training_engine(args, value_model)
    ref_policy = frozen_engine(args, load_model(args, args.sft_model_path))
    reward_model = frozen_engine(args, load_model(args, args.reward_model_path, reward=True))
    gold_model = frozen_engine(args, load_model(args, args.gold_reward_model_path, reward=True))

    start_update, episode, resumed_batches = 0, 0, []
    if args.resume:
        start_update, episode = load_checkpoint(latest_checkpoint(args.resume), {"policy": policy, "value_model": value_model})
        resumed_batches = load_generated_batches(latest_checkpoint(args.resume))

    # vLLM on rank 0 and its generator thread, fed the learner's weights as they change (start_generation).
    off_policy_steps = 0 if args.sync else args.off_policy_steps  # K
    generator, transfer, weights_dir, checked_names = start_generation(
        args, policy, run_name, run_dir, rank, device, tokenizer, train_prompts, eval_prompts[:4], stop_id,
        prompts_per_rank, 1, start_update, resumed_batches)

    run_log = RunLog(args, run_dir, run_name, start_update)  # metrics.jsonl (rank 0), wandb with --track
    if rank == 0:
        print(f"run {run_dir}: {args.num_updates} updates of {args.batch_size} responses (one per prompt)", flush=True)

    pad = tokenizer.pad_token_id
    progress = tqdm(total=args.num_updates * args.batch_size, initial=episode, unit="ep", disable=rank != 0)
    if not args.resume:  # the curves start from the SFT policy
        eval_metrics, samples = evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer,
                                         stop_id, device)
        run_log.log(0, {**eval_metrics, "episode": 0}, samples)
    start_time, start_episode = time.time(), episode
    for update in range(start_update + 1, args.num_updates + 1):
        # 1. Take the next batch from the generator: one response per prompt, generated by policy `batch.version`.
        t0 = time.time()
        batch = [generator.get() if rank == 0 else None]
        dist.broadcast_object_list(batch, src=0)
        batch = batch[0]
        indices = prompt_batch(len(train_prompts), prompts_per_rank, update - 1, args.seed, rank, args.world_size)
        queries = left_pad([train_prompts[i] for i in indices], pad, device)
        answers = [train_answers[i] for i in indices]
        context_length = queries.shape[1]
        responses = truncate_response(right_pad(batch.responses[rank], pad, device), stop_id, pad)
        query_responses = torch.cat([queries, responses], 1)
        padding_mask = responses == pad  # everything after the response
        behaviour_logprobs = right_pad(batch.logprobs[rank], 0.0, device).masked_fill(padding_mask, 0.0)
        t1 = time.time()

        # 2. Score: log-probabilities under the policy and the reference, values, reward-model scores.
        logprobs, ref_logprobs, values, scores = [], [], [], []
        with torch.no_grad():
            for i in range(0, len(query_responses), args.per_device_train_batch_size):
                chunk = query_responses[i: i + args.per_device_train_batch_size]
                chunk_responses = chunk[:, context_length:]
                logprobs.append(response_logprobs(forward(policy, chunk, pad).logits, chunk_responses,
                                                  context_length, args.temperature))
                ref_logprobs.append(response_logprobs(forward(ref_policy, chunk, pad).logits, chunk_responses,
                                                      context_length, args.temperature))
                values.append(value_forward(value_model, chunk, pad, context_length))
                scores.append(score_responses(args, reward_model, chunk, context_length,
                                              answers[i: i + args.per_device_train_batch_size], tokenizer))
        logprobs = torch.cat(logprobs).masked_fill(padding_mask, 0.0)
        ref_logprobs = torch.cat(ref_logprobs).masked_fill(padding_mask, 0.0)
        values = torch.cat(values).masked_fill(padding_mask, 0.0)
        raw_scores = torch.cat(scores)
        scores = apply_missing_eos_penalty(raw_scores, responses, stop_id, args.missing_eos_penalty,
                                           args.missing_eos_mode)

        # 3. Per-token rewards, GAE advantages (whitened) and returns (not whitened), and the off-policy correction:
        #    each token's importance weight pi_prox / pi_behaviour (the learner's over vLLM's; its response's with
        #    --is-level sequence or geometric), truncated at --is-cap (or masked above it).
        kl = (logprobs - ref_logprobs).sum(1)
        rewards = token_rewards(scores, logprobs, ref_logprobs, padding_mask, args.kl_coef)
        advantages, returns = gae_advantages(rewards, values, padding_mask, args.gamma, args.lam)
        advantages = masked_whiten(advantages, ~padding_mask).masked_fill(padding_mask, 0.0)
        non_score_reward = -args.kl_coef * kl
        rlhf_reward = scores + non_score_reward
        is_weights, is_stats = importance_weights(logprobs, behaviour_logprobs, ~padding_mask, args.is_cap,
                                                  args.is_level, args.is_mode)
        is_weights = is_weights.view(len(logprobs), -1).expand_as(logprobs)  # a response's weight on each token
        t2 = time.time()

        # 4. PPO updates of the policy (importance-weighted) and the value model over mini-batches of this batch.
        stats = {name: [] for name in ("loss", "value_loss", "approxkl", "clipfrac", "value_clipfrac", "ratio",
                                       "entropy")}
        local_mini_batch = args.local_batch_size // args.num_mini_batches
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, device=device)
            for mb_start in range(0, args.local_batch_size, local_mini_batch):
                for mc_start in range(mb_start, mb_start + local_mini_batch, args.per_device_train_batch_size):
                    idx = order[mc_start: mc_start + args.per_device_train_batch_size]
                    mask = ~padding_mask[idx]
                    logits = forward(policy, query_responses[idx], pad).logits
                    new_logprobs = response_logprobs(logits, responses[idx], context_length, args.temperature)
                    new_logprobs = new_logprobs.masked_fill(padding_mask[idx], 0.0)
                    loss, log_ratio, ratio, clipped = ppo_policy_loss(new_logprobs, logprobs[idx], advantages[idx],
                                                                      mask, args.cliprange, is_weights[idx])
                    new_values = value_forward(value_model, query_responses[idx], pad, context_length)
                    value_loss, value_clipped = ppo_value_loss(new_values, values[idx], returns[idx], mask,
                                                               args.cliprange_value)
                    policy.backward(loss)
                    value_model.backward(args.vf_coef * value_loss)
                    policy.step()
                    value_model.step()
                    with torch.no_grad():
                        entropy = entropy_from_logits(logits[:, context_length - 1: -1] / args.temperature)
                        stats["loss"].append(loss)
                        stats["value_loss"].append(value_loss)
                        stats["approxkl"].append(0.5 * masked_mean(log_ratio ** 2, mask))
                        stats["clipfrac"].append(masked_mean(clipped.float(), mask))
                        stats["value_clipfrac"].append(masked_mean(value_clipped.float(), mask))
                        stats["ratio"].append(masked_mean(ratio, mask))
                        stats["entropy"].append(masked_mean(entropy, mask))
        logits = None  # batch x length x vocabulary: not held through the steps that follow
        get_accelerator().synchronize()  # a GPU may still run the optimizer's step: it counts as training
        t3 = time.time()

        # 5. Hand the new weights to vLLM, if a later batch is to be generated by them.
        waited = 0.0  # for the generator to finish batches of older policies: idle, like waiting for a batch
        if generating_version(args.num_updates, start_update, off_policy_steps) >= update:
            check = args.check_weights_every and (update == start_update + 1 or update % args.check_weights_every == 0)
            expected = learner_weight_check(policy, eval_prompts[:4], checked_names, pad, device) if check else None
            waited = hand_over_weights(policy, update, transfer=transfer, generator=generator,
                                       weights_dir=weights_dir, expected=expected)
        t4 = time.time()

        # 6. Log, evaluate, save.
        episode += args.batch_size
        progress.update(args.batch_size)
        step_means = {name: torch.stack(per_step).mean().item() for name, per_step in stats.items()}
        metrics = mean_over_ranks({
            "objective/scores": scores.mean().item(),
            "objective/raw_scores": raw_scores.mean().item(),
            "objective/kl": proximal_mean(kl, logprobs, behaviour_logprobs, ~padding_mask),
            "objective/non_score_reward": non_score_reward.mean().item(),
            "objective/rlhf_reward": rlhf_reward.mean().item(),
            "objective/entropy": (-logprobs).sum(1).mean().item(),
            "policy/entropy_avg": step_means["entropy"],
            "loss/policy_avg": step_means["loss"],
            "loss/value_avg": step_means["value_loss"],
            "policy/approxkl_avg": step_means["approxkl"],
            "policy/clipfrac_avg": step_means["clipfrac"],
            "val/clipfrac_avg": step_means["value_clipfrac"],
            "val/ratio": step_means["ratio"],
            "val/ratio_var": torch.stack(stats["ratio"]).var().item() if len(stats["ratio"]) > 1 else 0.0,
            "val/explained_variance": explained_variance(values, returns, ~padding_mask).item(),
            "val/num_eos_tokens": (responses == stop_id).sum().item() * args.world_size,
            "val/response_length": (~padding_mask).sum(1).float().mean().item(),
            "async/off_policy_steps": update - 1 - batch.version,
            "async/mismatch_kl": mismatch_kl(logprobs, behaviour_logprobs, ~padding_mask),
            **is_stats,
            "time/generation": batch.generation_time,
            "time/generation_wait": t1 - t0 + waited,
            "time/scoring": t2 - t1,
            "time/training": t3 - t2,
            "time/weight_sync": t4 - t3 - waited,
            "time/weight_load": batch.load_time,
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
        progress.set_postfix(score=f"{metrics['objective/scores']:.3f}", kl=f"{metrics['objective/kl']:.2f}",
                             eps=f"{metrics['time/episodes_per_second']:.0f}")
        if (args.save_every and update % args.save_every == 0) or update == args.num_updates:
            # The batches already generated for the next K updates go into the checkpoint: a resumed run trains
            # on them as this one will, so that an asynchronous run resumes exactly.
            ahead = generator.peek(min(off_policy_steps, args.num_updates - update)) if rank == 0 else []
            save_checkpoint(args, run_dir, update, episode, {"policy": policy, "value_model": value_model},
                            extra_files={GENERATED_BATCHES: [batch._asdict() for batch in ahead]})

    progress.close()
    if rank == 0:
        generator.close()
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
    check_bounds(args, positive=("cliprange", "cliprange_value", "vf_coef", "generation_timeout"),
                 at_least_0=("kl_coef", "is_cap", "check_weights_every"))
    for name in ("gamma", "lam"):
        if not 0 <= getattr(args, name) <= 1:
            fail(name, f"must be between 0 and 1, got {getattr(args, name)}")
    if args.off_policy_steps < 1:
        fail("off_policy_steps", f"must be at least 1 (use --sync for on-policy), got {args.off_policy_steps}")
    if args.is_level not in ("token", "sequence", "geometric"):
        fail("is_level", f"must be token, sequence or geometric, got {args.is_level!r}")
    if args.is_mode not in ("truncate", "mask"):
        fail("is_mode", f"must be truncate or mask, got {args.is_mode!r}")
    check_weight_sync(args)
    if args.vllm_gpu_memory_utilization is not None and not 0 < args.vllm_gpu_memory_utilization <= 1:
        fail("vllm_gpu_memory_utilization", f"must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
    if not torch.cuda.is_available() and not 1 <= args.vllm_cpu_cores < len(os.sched_getaffinity(0)):
        fail("vllm_cpu_cores", f"must leave the learner at least one of this machine's "
                               f"{len(os.sched_getaffinity(0))} cores, got {args.vllm_cpu_cores}")
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


# ===========================================================================================================
# Asynchronous generation, identical in every *_vllm.py: vLLM on rank 0 fed by a background thread, the
# schedule of policy versions, and the hand-off of the learner's weights.
# ===========================================================================================================

def vllm_gpu_placement(env, num_node_gpus, vllm_gpu=None):
    """vLLM's GPU: (its engine's CUDA_VISIBLE_DEVICES entry, the CUDA index on rank 0 of the training GPU it shares or
    None when it has its own), a pure function of the launcher's environment. Training ranks use the first entries of
    CUDA_VISIBLE_DEVICES (all GPUs when unset), one per local rank: as many as LOCAL_SIZE under deepspeed's launcher
    (which sets CUDA_VISIBLE_DEVICES to exactly those), LOCAL_WORLD_SIZE under torchrun, 1 under `python`. vLLM takes
    --vllm-gpu (a training GPU only if rank 0's, whose process hands vLLM the weights and leaves it memory), else the
    next visible entry, else (deepspeed only: its --num_gpus hid the rest of the node) the first node GPU no rank uses,
    else rank 0's GPU, shared. Entries are CUDA's own (indices in CUDA's order, UUIDs or MIG names), passed on
    unchanged, so NVML's other numbering never enters; NVML only counts the node's GPUs."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    entries = [e.strip() for e in visible.split(",") if e.strip()] if visible else [str(i) for i in range(num_node_gpus)]
    local_ranks = int(env.get("LOCAL_SIZE") or env.get("LOCAL_WORLD_SIZE") or 1)
    training, rest = entries[:local_ranks], entries[local_ranks:]
    if vllm_gpu is not None:
        choice = str(vllm_gpu)
        if choice in training[1:]:
            fail("vllm_gpu", f"GPU {choice} is training rank {training.index(choice)}'s: vLLM may share rank 0's only")
    elif rest:
        choice = rest[0]
    elif "LOCAL_SIZE" in env and all(e.isdigit() for e in training) and len(training) < num_node_gpus:
        choice = next(str(i) for i in range(num_node_gpus) if str(i) not in training)
    else:
        choice = training[0]
    return choice, (entries.index(choice) if choice in training else None)


def vllm_memory_share(requested, free_bytes, total_bytes, gpu):
    """vLLM's gpu_memory_utilization on a GPU training already uses, and the learner's share of the GPU then: vLLM
    starts only if its share of the total memory is free once its process has a CUDA context (about 0.5 GiB; 1 GiB is
    kept for it), and it frees and takes again its activations' memory at every batch, so the learner's allocator is
    held to the rest (the learner, not vLLM, runs out of memory). Default: half the free memory (the rest is for
    training's activations and optimizer state)."""
    share = requested if requested is not None else int(50 * free_bytes / total_bytes) / 100
    if share * total_bytes > free_bytes - 2**30 or (requested is None and share * total_bytes < 2**30):
        fail("vllm_gpu_memory_utilization", f"GPU {gpu}, shared with training, has {free_bytes / 2**30:.1f} of "
                                            f"{total_bytes / 2**30:.1f} GiB free, too little for vLLM to take "
                                            f"{share:.2f} of it (give vLLM a GPU of its own with --vllm-gpu)")
    return share, 1 - share - 2**30 / total_bytes


def start_vllm(args, model_path, weight_transfer=False):
    """A vLLM engine for `model_path` in its own process (vLLM's default) on its own device: CUDA_VISIBLE_DEVICES (GPU)
    or VLLM_CPU_OMP_THREADS_BIND (CPU cores), which the engine process reads, are set only while it starts. With
    `weight_transfer` it takes weights in memory (weight_transfer()): NCCL on a GPU of its own, CUDA IPC on one it
    shares (on a CPU: vLLM's "nccl" engine, provided only by the tests' plugin tests/cpu_weight_transfer)."""
    from vllm import LLM

    # Log-probabilities returned with samples are those of the distribution sampled from (after temperature).
    engine_args = dict(model=model_path, dtype="bfloat16" if args.bf16 else "float32", seed=args.seed,
                       max_model_len=args.max_prompt_length + args.response_length, logprobs_mode="processed_logprobs",
                       enforce_eager=args.vllm_enforce_eager, trust_remote_code=args.trust_remote_code)
    if torch.cuda.is_available():
        import pynvml  # counts the node's GPUs, also those the deepspeed launcher hid from this process

        pynvml.nvmlInit()
        gpu, shared = vllm_gpu_placement(os.environ, pynvml.nvmlDeviceGetCount(), args.vllm_gpu)
        share = 0.9 if args.vllm_gpu_memory_utilization is None else args.vllm_gpu_memory_utilization
        if shared is not None:
            torch.cuda.empty_cache()  # blocks the learner's allocator holds but does not use are free for vLLM
            share, learner = vllm_memory_share(args.vllm_gpu_memory_utilization, *torch.cuda.mem_get_info(shared), gpu)
            torch.cuda.set_per_process_memory_fraction(learner, shared)
            print(f"vLLM shares GPU {gpu} with training and takes {share:.2f} of its memory "
                  "(--vllm-gpu-memory-utilization); it has no GPU of its own", flush=True)
        else:
            print(f"vLLM runs on GPU {gpu}, a GPU of its own (its engine's CUDA_VISIBLE_DEVICES)", flush=True)
        env = {"CUDA_VISIBLE_DEVICES": gpu}
        engine_args["gpu_memory_utilization"] = share
    else:
        cores = sorted(os.sched_getaffinity(0))[-args.vllm_cpu_cores:]
        env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
        # vLLM on CPU would reserve most of the memory for its KV cache: bound it by one batch's keys and values.
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
        per_token = 2 * config.num_hidden_layers * config.hidden_size * (2 if args.bf16 else 4)
        engine_args["kv_cache_memory_bytes"] = max(2 * per_token * args.batch_size * engine_args["max_model_len"],
                                                   64 * 2**20)
        # A prefill split over steps makes vLLM rewind its seeded sampler, which torch's CPU generator cannot do.
        engine_args["enable_chunked_prefill"] = False
        shared = None
    if weight_transfer:
        engine_args["weight_transfer_config"] = {"backend": "nccl" if shared is None else "ipc"}
        if shared is not None:
            allow_pickled_rpc(os.environ)
    with unittest.mock.patch.dict(os.environ, env):  # set while the engine starts, restored after
        return LLM(**engine_args)


def allow_pickled_rpc(environ):
    """Let vLLM's RPC carry the CUDA IPC hand-off: its update names each buffer's CUDA handle with torch classes and a
    dtype, which vLLM's msgpack encoder sends (pickled, over its local sockets between this process and its engine's)
    only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, read here at each call and by the engine's processes when they
    start. Set for the run's whole life, before the engine starts."""
    environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def pin_vllm_to_its_cores(args):
    """On CPU, asynchronously: bind vLLM's work to its --vllm-cpu-cores; called by the generator thread.
    VLLM_CPU_OMP_THREADS_BIND binds only the worker's compute threads. The engine-core process busy-waits
    (sched_yield) for the worker at every decoding step, and in this process vLLM's output thread and the generator
    decode and process every step's tokens: on the learner's cores they slow training by 15-20 %
    (docs/results.md). So every thread of this process's children (vLLM's processes), that output thread and the
    calling thread go to vLLM's cores. With --sync the learner is idle while vLLM generates: vLLM may use every core."""
    if torch.cuda.is_available() or args.sync:
        return
    import psutil

    cores = sorted(os.sched_getaffinity(0))[-args.vllm_cpu_cores:]
    threads = [thread.id for child in psutil.Process().children(recursive=True) for thread in child.threads()]
    threads += [t.native_id for t in threading.enumerate() if t.name == "EngineCoreOutputQueueThread"]
    for thread in threads + [threading.get_native_id()]:
        with contextlib.suppress(OSError):  # a thread that has ended since
            os.sched_setaffinity(thread, cores)


def vllm_generate(llm, prompts, k, response_length, stop_token_id, temperature, seed):
    """k responses to each prompt (sample j of prompt i at j * len(prompts) + i) and the log-probability of each token
    under the weights that sampled it (the behaviour policy), at the sampling temperature. Request i gets seed + i, so a
    batch depends on the weights and seed only, not on what vLLM generated before (which keeps reruns and resumed runs
    exact). Temperature 0 is greedy. As in generate(), only the stop token ends a response (and is kept)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=prompt) for _ in range(k) for prompt in prompts]
    sampling = [SamplingParams(temperature=temperature, top_k=0, top_p=1.0, max_tokens=response_length,
                               ignore_eos=True, stop_token_ids=[stop_token_id], seed=seed + i, logprobs=0,
                               detokenize=False)  # token ids are all we use: no text decoded in this process
                for i in range(len(requests))]
    outputs = [output.outputs[0] for output in llm.generate(requests, sampling, use_tqdm=False)]
    return ([list(out.token_ids) for out in outputs],
            [[step[token].logprob for token, step in zip(out.token_ids, out.logprobs)] for out in outputs])


def load_into_vllm(llm, weights_path):
    """Replace the engine's weights by a save_pretrained directory's (vLLM's in-place reload, in its worker process) and
    empty the prefix cache: keyed by token ids, not weights, it would serve keys and values of the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
    llm.reset_prefix_cache()


def right_pad(sequences, pad_value, device):
    """Lists of token ids (an int pad value) or log-probabilities (a float one) as one padded tensor."""
    width = max(1, max(len(s) for s in sequences))
    out = torch.full((len(sequences), width), pad_value)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=out.dtype)
    return out.to(device)


def tied_output_names(module):
    """The names under which a model whose output layer is its input embedding (`tie_word_embeddings`: SmolLM2,
    Qwen2.5 up to 3B, Llama 3.2, Gemma) holds that weight a second time, such as ["lm_head.weight"]; else []."""
    embedding = module.get_input_embeddings().weight
    names = [name for name, p in module.named_parameters(remove_duplicate=False) if p is embedding]
    return names[1:]


def write_for_vllm(module, state_dict, path):
    """save_pretrained for vLLM: a tied output layer is written as a weight of its own, under a config that unties
    it. vLLM 0.32 ties such a layer to its embedding when it first loads, and its reloads (both hand-offs) skip it
    (`lm_head.*`): vLLM would go on sampling with the first weights' output layer. Untied, vLLM's copy costs one
    more embedding matrix of memory and of every hand-off; the learner's model stays tied."""
    tied = tied_output_names(module)
    if tied:
        embedding = state_dict[next(n for n, p in module.named_parameters() if p is module.get_input_embeddings().weight)]
        state_dict = {**state_dict, **{name: embedding.clone() for name in tied}}
    config = module.config.get_text_config()
    saved = config.tie_word_embeddings
    config.tie_word_embeddings = saved and not tied
    try:
        module.save_pretrained(path, state_dict=state_dict)
    finally:
        config.tie_word_embeddings = saved


def save_for_vllm(policy, path):
    """Write the policy's weights where vLLM can load them (write_for_vllm); every rank takes part, rank 0 writes."""
    state_dict = gathered_state_dict(policy)
    if dist.get_rank() == 0:
        write_for_vllm(policy.module, state_dict, path)


def in_thread(function, *args):
    """Start function(*args) in a daemon thread, so that a call stuck in a dead engine can be left behind rather
    than waited for; returns a queue that receives (its result, None) or (None, the exception it raised)."""
    box = queue.Queue(1)

    def run():
        try:
            box.put((function(*args), None))
        except BaseException as error:
            box.put((None, error))

    threading.Thread(target=run, name=getattr(function, "__name__", "call"), daemon=True).start()
    return box


def wait_for(source, what, timeout, check):
    """The next item of queue `source`, waiting at most `timeout` seconds; `check()` runs every 0.1 s meanwhile and
    raises to stop the wait (the generator failed, vLLM's engine died)."""
    deadline = time.time() + timeout
    while True:
        try:
            return source.get(timeout=0.1)
        except queue.Empty:
            check()
        if time.time() > deadline:
            raise TimeoutError(f"{what} took more than {timeout} s (--generation-timeout)")


def engine_dead(llm):
    """Whether vLLM's engine process has died (a generate() already waiting on it then never returns)."""
    return llm.llm_engine.engine_core.resources.engine_dead  # vLLM's private state: read here and in shut_down only


def shut_down(llm):
    """Stop vLLM's engine processes (LLM has no public call for it)."""
    llm.llm_engine.engine_core.shutdown(timeout=30)


class VllmClient:
    """vLLM's weight-sync calls on an engine (what vLLM's trainer-side weight transfer engines call: its
    VLLMWeightSyncClient), each bounded: a hand-off that hangs, the field's most reported failure, ends
    in an error naming its step, after `timeout` seconds or as soon as the engine process dies."""

    def __init__(self, llm, timeout):
        self.llm, self.timeout = llm, timeout
        self.failure = None  # the error of a call that failed, for hand_off_watchdog()
        self.abandoned = False  # set by hand_off_watchdog() when the learner's end fails: calls in flight end

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self.call("start_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update")
        self.call("reset_prefix_cache")  # see load_into_vllm

    def call(self, step, *request):
        def check():
            if engine_dead(self.llm):
                raise RuntimeError(f"vLLM's engine process died during {step}")
            if self.abandoned:
                raise RuntimeError(f"{step} abandoned: the learner's end of the hand-off failed")

        # The learner may be in a collective vLLM's worker left or never joins: hand_off_watchdog() must know at once.
        try:
            result, error = wait_for(in_thread(getattr(self.llm, step), *request), step, self.timeout, check)
        except Exception as error:  # the engine died, or the call did not return in time
            self.failure = f"weight hand-off: {error}"
            raise
        if error is not None:  # raised in vLLM's worker (out of memory for its buffers, ...)
            cause = (str(error).strip().splitlines() or [type(error).__name__])[-1]  # a worker's traceback ends so
            self.failure = f"weight hand-off: {step} failed in vLLM: {cause}"
            raise error
        return result


@contextlib.contextmanager
def hand_off_watchdog(step, client):
    """Bound a hand-off step that may never return: in a collective (NCCL's broadcast, gloo's) whose other end died or
    hangs, the learner waits for ever, out of any exception's reach. If the block still runs 5 s after `client` (a
    VllmClient) reports a failed call, or 5 s past its timeout, print one line naming the step, run the atexit clean-ups
    (vLLM's engine processes, the weights directory) and exit with code 1. Errors the block raises go the usual way,
    and end the client's calls in flight: vLLM's NCCL sender leaves its worker's update_weights running in a thread
    that Python joins at exit, which would otherwise wait for the worker (never, as it waits in the broadcast)."""
    ended = threading.Event()

    def watch():
        started, failed = time.time(), None
        while not ended.wait(0.1):
            failed = failed or (client.failure and time.time())
            if (failed and time.time() > failed + 5) or time.time() > started + client.timeout + 5:
                message = client.failure or f"weight hand-off: {step} did not end in {client.timeout} s (--generation-timeout)"
                print(f"error: {message}", file=sys.stderr, flush=True)
                atexit._run_exitfuncs()  # the main thread, stuck, will never run them
                os._exit(1)

    threading.Thread(target=watch, name="hand-off watchdog", daemon=True).start()
    try:
        yield
    except BaseException:
        client.abandoned = True
        raise
    finally:
        ended.set()


class PolicyWeights:
    """The policy's parameters as vLLM's trainer-side weight transfer engines take them (a vLLM WeightSource): their
    names, dtypes and shapes up front, then the tensors one at a time in the same order. Every rank iterates: under
    ZeRO-3 each module's parameters are gathered in turn and released after, so no device holds the whole model.
    A tied weight goes under each of its names: vLLM's copy is untied (write_for_vllm). `names` keeps only those."""

    def __init__(self, module, names=None):
        self.module, self.names = module, names

    def _by_module(self):
        for prefix, submodule in self.module.named_modules():
            own = [(name, p) for name, p in submodule.named_parameters(prefix=prefix, recurse=False,
                                                                        remove_duplicate=False)
                   if self.names is None or name in self.names]
            if own:
                yield own

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))  # ds_shape: ZeRO-3's full shape
                for own in self._by_module() for name, p in own]

    def __iter__(self):
        for own in self._by_module():
            with deepspeed.zero.GatheredParameters([p for _, p in own]):  # does nothing unless ZeRO-3 partitioned them
                for name, p in own:  # a gathered parameter is copied: its memory goes when the context ends
                    yield name, p.detach().clone() if hasattr(p, "ds_id") else p.detach()


def check_weight_sync(args):
    """--weight-sync, by default memory on a GPU and file on a CPU: vLLM moves weights in memory on GPUs only (NCCL,
    CUDA IPC), or on a CPU with the tests' vLLM plugin, cpu_weight_transfer (its "nccl" engine over gloo)."""
    cuda = torch.cuda.is_available()
    if args.weight_sync is None:
        args.weight_sync = "memory" if cuda else "file"
    if args.weight_sync not in ("memory", "file"):
        fail("weight_sync", f"must be memory or file, got {args.weight_sync!r}")
    if args.weight_sync == "memory" and not cuda and \
            not importlib.metadata.entry_points(group="vllm.general_plugins", name="cpu_weight_transfer"):
        fail("weight_sync", "memory needs a GPU (vLLM's NCCL or CUDA IPC weight transfer); use file on a CPU")


def weight_transfer(args, llm, module, rank):
    """The learner's end of the in-memory weight hand-off: vLLM's trainer-side engine for the backend vLLM's engine
    was started with (start_vllm: NCCL to a GPU of its own, CUDA IPC on one it shares), connected to it. Every rank
    calls this and its send_weights(): rank 0 sends, the others take part in ZeRO-3's gathers."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    backend = [llm.llm_engine.vllm_config.weight_transfer_config.backend if rank == 0 else None]
    if args.world_size > 1:  # the other ranks learn it from rank 0
        dist.broadcast_object_list(backend, src=0)
    source = PolicyWeights(module)
    buffer_bytes = packed_buffer_bytes(source.metadata())
    if backend[0] == "nccl":
        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=rank, packed_buffer_size_bytes=buffer_bytes)
    else:  # packed: in bounded chunks (unpacked, it would keep a copy of every tensor until the update ends)
        info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=buffer_bytes)
    if rank != 0:
        return WeightTransferTrainerFactory.trainer_init(info, client=None, source=source)
    client = VllmClient(llm, args.generation_timeout)
    with hand_off_watchdog("connecting to vLLM's worker", client):
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


def packed_buffer_bytes(metadata, bound=256 * 2**20):
    """Size of the buffers that vLLM's NCCL and CUDA IPC transfers pack parameters into: 256 MiB, or the largest
    parameter's bytes if more (CUDA IPC packs into one buffer of exactly this size and refuses a larger tensor).
    This GPU memory is outside vLLM's --vllm-gpu-memory-utilization share: CUDA IPC keeps one buffer on rank 0's GPU;
    NCCL packs into two in flight on rank 0 and vLLM's worker receives into two, each up to this plus the largest
    parameter (at vLLM's default, 1 GiB, that is 2 GiB or more on each side)."""
    return max([bound] + [math.prod(m.shape) * m.dtype.itemsize for m in metadata])


def hand_over_weights(policy, version, *, transfer, generator, weights_dir, expected=None):
    """Give vLLM policy version `version`: in memory by `transfer` (weight_transfer()), or if None as a save_pretrained
    directory the generator loads; given `expected` (a WeightCheck), the generator then checks vLLM's weights. Every
    rank calls this (`generator`: rank 0's, else None). Returns the seconds waited for older policies' batches."""
    path, waited = None, 0.0
    if transfer is None:
        path = os.path.join(weights_dir, f"policy-{version}")
        save_for_vllm(policy, path)
    else:
        if generator is not None:  # vLLM's weights change between batches only, when the generator wants this version
            start = time.time()
            generator.wait_for_receiver(version)
            waited = time.time() - start
        try:
            if torch.cuda.is_available():  # the optimizer's step may still run on the default stream, and vLLM's NCCL
                torch.cuda.current_stream().synchronize()  # packer reads the parameters on streams of its own
            client = getattr(transfer, "client", None)  # rank 0's
            with hand_off_watchdog(f"sending version {version}", client) if client else contextlib.nullcontext():
                transfer.send_weights()
        except Exception as error:
            if generator is not None:  # the likeliest cause: vLLM's engine died ("the generator failed: ...")
                generator.raise_if_failed()
            raise RuntimeError(f"handing version {version} of the policy to vLLM failed: {error}") from error
    if generator is not None:
        generator.publish(version, path, finish=getattr(transfer, "finish", None), expected=expected)
    return waited


class WeightCheck(NamedTuple):
    """What vLLM must hold after loading a policy version, per the learner at hand-over (check_vllm_weights() compares):
    the probe tokens' log-probabilities and the digests of the parameters that matched when vLLM started."""
    logprobs: list
    digests: dict


class WeightsDiffer(Exception):
    """vLLM does not hold the learner's weights: the run stops with this one line."""


PROBE_TOLERANCE = {False: 1e-3, True: 0.25}  # the mean |difference| of log-probabilities allowed, by --bf16; vLLM
# against the learner with the same weights on a CPU: 5e-6 (SmolLM2) and 6e-7 (tiny) in float32, 0.07 and 8e-4 in bfloat16


def weight_digests(named_tensors):
    """sha256 of each tensor's bytes, as vLLM's own compute_weight_checksums hashes its parameters."""
    return {name: hashlib.sha256(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()
            for name, t in named_tensors}


def vllm_digests(llm):
    """vLLM's digest of each parameter of its model (one worker: no tensor parallelism), by parameter name."""
    (digests,) = llm.collective_rpc("compute_weight_checksums")
    return {name.rsplit(":", 1)[-1]: digest for name, digest in digests.items()}  # "dp0:pp0:pcp0:tp0:<name>"


@torch.no_grad()
def learner_weight_check(policy, probe, names, pad_token_id, device):
    """The learner's current WeightCheck (all ranks take part; rank 0's is used): log-probabilities at temperature 1 of
    each probe sequence's tokens after its first, and digests of `names` (None: all parameters, under each name)."""
    ids = left_pad(probe, pad_token_id, device)
    logprobs = response_logprobs(forward(policy, ids, pad_token_id).logits, ids[:, 1:], 1, 1.0)
    digests = weight_digests(PolicyWeights(policy.module, names))
    return WeightCheck([row[len(row) - len(p) + 1:].tolist() for row, p in zip(logprobs, probe)], digests)


def check_vllm_weights(llm, version, probe, expected, bf16):
    """Raise WeightsDiffer (the run stops) unless vLLM holds policy version `version`: its prompt log-probabilities of
    the probe (temperature 1) within PROBE_TOLERANCE of the learner's, every expected digest equal."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sampling = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in probe], sampling, use_tqdm=False)
    vllm_logprobs = [[step[token].logprob for token, step in zip(p[1:], out.prompt_logprobs[1:])]
                     for p, out in zip(probe, outputs)]
    difference = torch.tensor([v - e for got, want in zip(vllm_logprobs, expected.logprobs)
                               for v, e in zip(got, want)]).abs()
    digests = vllm_digests(llm) if expected.digests else {}
    differ = [name for name, digest in expected.digests.items() if digests.get(name) != digest]
    if differ or not difference.mean() <= PROBE_TOLERANCE[bf16]:
        where = (f"parameters that differ: {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}" if differ else
                 f"largest at probe token {difference.argmax().item()}; no parameter vLLM keeps as the learner does differs")
        raise WeightsDiffer(f"vLLM does not hold version {version} of the learner's policy: its log-probabilities of "
                            f"the probe differ by {difference.mean():.2e} on average (tolerance "
                            f"{PROBE_TOLERANCE[bf16]:.0e}); {where} (--check-weights-every)")


def exit_on_signals():
    """Make SIGTERM and SIGINT exit through the atexit clean-ups (vLLM's engine processes, the weights directory), also
    while vLLM starts, where a KeyboardInterrupt would be lost. A job started with `&` keeps ignoring Ctrl-C."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))


def weights_root(run_dir, needed_bytes, shm="/dev/shm"):
    """Where the weights handed to vLLM go: memory (/dev/shm) when it has room for `needed_bytes`, else the
    run directory, said in one line. A container's /dev/shm is often 64 MB."""
    if os.path.isdir(shm) and shutil.disk_usage(shm).free >= needed_bytes:
        return shm
    print(f"warning: {shm} has no room for {needed_bytes / 2**20:.0f} MiB of weights handed to vLLM; "
          f"they go through {run_dir} (disk)", file=sys.stderr, flush=True)
    return run_dir


def generating_version(update, first_version, off_policy_steps):
    """The policy version that generates batch `update` (version v is the policy after v updates): the one
    off_policy_steps (K) updates before the version that trains on it, never one before the run started."""
    return max(first_version, update - 1 - off_policy_steps)


def start_generation(args, policy, run_name, run_dir, rank, device, tokenizer, train_prompts, probe, stop_id,
                     prompts_per_rank, k, start_update, resumed_batches):
    """On rank 0, vLLM started from the learner's weights (version start_update: the SFT policy or the resumed one) in a
    save_pretrained directory, and its generator thread; on every rank, the weight check's first pass and the in-memory
    hand-off. Later versions go in memory (--weight-sync memory) or through such directories, in /dev/shm if it has room
    for the K + 1 versions that can be in flight at once, else in the run directory, each deleted once loaded; rank 0's
    process id keeps two runs of one name (a sweep) apart. Returns (rank 0's GenerationThread, else None; the hand-off,
    weight_transfer(), or None; the versions' directory; the parameters the weight check digests, None: all)."""
    off_policy_steps = 0 if args.sync else args.off_policy_steps  # K
    version_bytes = sum(getattr(p, "ds_numel", p.numel()) for p in policy.module.parameters()) * (2 if args.bf16 else 4)
    copies = off_policy_steps + 1 if args.weight_sync == "file" else 1
    root = weights_root(run_dir, copies * version_bytes) if rank == 0 else run_dir  # only rank 0 writes
    weights_dir = os.path.join(root, f"{run_name}-{os.getpid()}-weights")
    exit_on_signals()
    atexit.register(shutil.rmtree, weights_dir, ignore_errors=True)
    first = os.path.join(weights_dir, f"policy-{start_update}")
    save_for_vllm(policy, first)
    llm = generator = None
    if rank == 0:
        AutoTokenizer.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code).save_pretrained(first)
        llm = start_vllm(args, first, args.weight_sync == "memory")
        shutil.rmtree(first)
        generator = GenerationThread(args, llm, weights_dir=weights_dir, train_prompts=train_prompts,
                              prompts_per_rank=prompts_per_rank, k=k, stop_id=stop_id, first_version=start_update,
                              off_policy_steps=off_policy_steps, probe=probe, resumed_batches=resumed_batches)
        atexit.register(generator.close)  # on every way out: the end, an error, Ctrl-C, SIGTERM
    # The weight check (--check-weights-every): vLLM's log-probabilities of the probe against the learner's, and the
    # digests of the parameters vLLM keeps as the learner does (found now: every one on a GPU; on a CPU vLLM repacks
    # its linear layers, so embeddings and norms), first here, then after hand-offs.
    checked_names = [None]
    if args.check_weights_every:
        expected = learner_weight_check(policy, probe, None, tokenizer.pad_token_id, device)
        if rank == 0:
            digests = vllm_digests(llm)
            checked_names = [sorted(n for n, d in expected.digests.items() if digests.get(n) == d)]
            try:
                check_vllm_weights(llm, start_update, probe,
                                   expected._replace(digests={n: expected.digests[n] for n in checked_names[0]}), args.bf16)
            except WeightsDiffer as error:
                sys.exit(f"error: {error}")
        dist.broadcast_object_list(checked_names, src=0)
    # The in-memory hand-off connects before the generator starts: then only its thread uses vLLM (but while it waits
    # for weights, see wait_for_receiver()).
    transfer = weight_transfer(args, llm, policy.module, rank) if args.weight_sync == "memory" else None
    if rank == 0:
        generator.start()
    return generator, transfer, weights_dir, checked_names[0]


class GeneratedBatch(NamedTuple):
    """One update's batch: the policy version that generated it, each rank's responses (sample j of prompt i at
    j * prompts_per_rank + i) and their tokens' log-probabilities under that version (the behaviour policy), and
    the seconds spent generating it and loading its version into vLLM."""
    version: int
    responses: list
    logprobs: list
    generation_time: float
    load_time: float


GENERATED_BATCHES = "generated_batches.json"


def load_generated_batches(checkpoint):
    """The batches a checkpoint kept for the updates after it (none from --sync runs or older checkpoints)."""
    path = os.path.join(checkpoint, GENERATED_BATCHES)
    if dist.get_rank() != 0 or not os.path.exists(path):
        return []
    with open(path) as f:
        return [GeneratedBatch(**batch) for batch in json.load(f)]


class GenerationThread:
    """vLLM on rank 0, generating in a background thread while the learner trains: the engine runs in its own process,
    so generation and training overlap; this thread only feeds it, each batch with the version generating_version()
    names, which it waits for. The learner hands every version over with publish() (in memory: sending it while the
    generator waits, see wait_for_receiver()) and takes the batches, in order, with get(). Every wait is bounded by
    --generation-timeout; a generator error or vLLM's engine dying is raised in the learner."""

    def __init__(self, args, llm, *, weights_dir, train_prompts, prompts_per_rank, k, stop_id, first_version,
                 off_policy_steps, probe, resumed_batches=()):
        self.args, self.llm, self.weights_dir, self.stop_id, self.probe = args, llm, weights_dir, stop_id, probe
        self.train_prompts, self.prompts_per_rank, self.k = train_prompts, prompts_per_rank, k
        self.first_version, self.off_policy_steps = first_version, off_policy_steps
        self.batches, self.versions, self.receivers = queue.Queue(), queue.Queue(), queue.Queue()
        # Batches get() returns before the queue's: those a checkpoint kept (not generated again), then peek()'s.
        self.ahead = collections.deque(resumed_batches)
        self.first_update = first_version + 1 + len(self.ahead)
        self.error, self.stopping = None, threading.Event()
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)

    def start(self):
        self.thread.start()

    def publish(self, version, weights_path=None, finish=None, expected=None):
        """Hand the generator version `version`: a save_pretrained directory it loads and deletes, or None (in memory;
        `finish`, if given, completes the update); given `expected` (a WeightCheck) it checks vLLM's weights."""
        self.versions.put((version, weights_path, finish, expected))

    def wait_for_receiver(self, version):
        """Wait until the generator has generated every batch of older policies and waits for this version: then the
        learner may replace vLLM's weights in memory."""
        ready = self._take(self.receivers, f"the generator's batches before version {version} of the policy",
                           check=self.raise_if_failed)
        assert ready == version, (ready, version)

    def get(self):
        """The next GeneratedBatch; raises the generator's error, or the engine's death, as soon as either happens."""
        if self.ahead:
            return self.ahead.popleft()
        return self._take(self.batches, "a generation batch", check=self.raise_if_failed)

    def peek(self, n):
        """The next n batches, left for get(): for a checkpoint, which keeps the batches generated for the next K
        updates (by policies older than the checkpoint's, so they are waited for, not regenerated on resume)."""
        while len(self.ahead) < n:
            self.ahead.append(self._take(self.batches, "a generation batch", check=self.raise_if_failed))
        return list(self.ahead)[:n]

    def close(self):
        """Stop the thread and the engine and delete the handed-over weights (safe to call twice)."""
        self.stopping.set()
        if self.args.weight_sync == "memory" and not engine_dead(self.llm):
            with contextlib.suppress(Exception):  # else vLLM's worker, holding the connection, exits 10 s later
                VllmClient(self.llm, timeout=5).call("shutdown_weight_transfer_engine")
        shut_down(self.llm)
        if self.thread.is_alive():
            self.thread.join(timeout=5)  # a daemon: if it is stuck in a dead engine, the process exits without it
        shutil.rmtree(self.weights_dir, ignore_errors=True)

    def raise_if_failed(self):
        if isinstance(self.error, WeightsDiffer):
            raise SystemExit(f"error: {self.error}")
        if self.error is not None:
            raise RuntimeError(f"the generator failed: {self.error!r}") from self.error
        if engine_dead(self.llm):
            raise RuntimeError("the generator failed: vLLM's engine process died")

    def _take(self, source, what, check, timeout=None):
        """The next item of a queue, waiting at most `timeout` (default --generation-timeout) seconds and calling
        `check` meanwhile."""
        def checks():
            check()
            if self.stopping.is_set():
                raise RuntimeError("the learner stopped")

        return wait_for(source, what, self.args.generation_timeout if timeout is None else timeout, checks)

    def _run(self):
        args, world_size = self.args, self.args.world_size
        try:
            pin_vllm_to_its_cores(args)
            loaded = self.first_version
            for update in range(self.first_update, args.num_updates + 1):
                t0 = time.time()
                while loaded < generating_version(update, self.first_version, self.off_policy_steps):
                    self.receivers.put(loaded + 1)  # for wait_for_receiver(): vLLM is idle until the next version
                    # No deadline: the next version comes after the learner's update, evaluation and checkpoint,
                    # however long they take; the learner's own waits are bounded, and its stopping ends this one.
                    loaded, weights_path, finish, expected = self._take(self.versions, "waiting for new weights",
                                                                        check=lambda: None, timeout=math.inf)
                    if weights_path is not None:
                        load_into_vllm(self.llm, weights_path)
                        shutil.rmtree(weights_path, ignore_errors=True)
                    if finish is not None:
                        finish()
                    if expected is not None:
                        check_vllm_weights(self.llm, loaded, self.probe, expected, args.bf16)
                t1 = time.time()
                # Every rank's prompts, rank after rank, as the synchronous scripts choose them.
                prompts = [self.train_prompts[i] for r in range(world_size) for i in
                           prompt_batch(len(self.train_prompts), self.prompts_per_rank, update - 1, args.seed, r,
                                        world_size)]
                # Request i gets this seed + i: seeds never repeat across batches (vllm_generate() says why).
                responses, logprobs = vllm_generate(self.llm, prompts, self.k, args.response_length, self.stop_id,
                                                    args.temperature, seed=args.seed * 2**32 + update * args.batch_size)
                # vLLM returns sample j of prompt p at j * len(prompts) + p, and rank r's prompt i is p =
                # r * prompts_per_rank + i: regroup per rank, sample-major like the synchronous scripts' batches.
                order = [[j * len(prompts) + r * self.prompts_per_rank + i for j in range(self.k)
                          for i in range(self.prompts_per_rank)] for r in range(world_size)]
                self.batches.put(GeneratedBatch(loaded, [[responses[n] for n in rank] for rank in order],
                                                [[logprobs[n] for n in rank] for rank in order],
                                                time.time() - t1, t1 - t0))
        except BaseException as error:  # handed to the learner, which raises it
            self.error = error


if __name__ == "__main__":
    main(tyro.cli(Args))
