"""Asynchronous GRPO on episodes of turns with a tool: the policy calls a calculator, the environment answers, and
only the policy's own tokens are trained on. A copy of grpo_vllm.py, as CleanRL's ppo_atari.py is of ppo.py (GRPO:
groups scored by a rule are how tool use is trained, and its per-token loss, KL and weights take a per-token mask).

A response is an episode: a turn of the policy that ends with a call (`<calc>47*8</calc>`) gets the result appended
(`<result>376</result>`, or an error) and the policy writes again; one that ends with the stop token is the final
answer; --max-turns and --response-length end an episode too. Token in, token out: the learner trains on the ids vLLM
sampled and the environment's as appended, never decoded and re-encoded; the environment's tokens have no weight in
the loss, KL, entropy, importance weights or async/mismatch_kl, and a policy token's behaviour log-probability is
vLLM's. The rule reads the final turn only. Streaming, an episode's next turn starts as soon as its last ends. The
rest is grpo_vllm.py's but DAPO's overlong shaping.

    python grpo_tools_vllm.py                          # the offline tiny tool task, vLLM on a CPU core
    python grpo_tools_vllm.py --sync --max-turns 2
"""

import functools
import os
import re
import time
from dataclasses import dataclass
from typing import Literal, NamedTuple, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from transformers import StaticCache

from checks import check_bounds, check_gpu_driver, check_lora, check_run, fail, parse_arguments, check_batch_sizes
from data import left_pad, load_data, load_model, prompt_batch, right_pad, with_lora
from distributed import adam_class, ds_config, frozen_engine, mean_over_ranks, reference_model, set_up_distributed
from checkpoints import check_resume, latest_checkpoint, load_checkpoint, save_checkpoint, stop_if_diverged
from runlog import RunLog, run_directory
from held_out import evaluate
from vllm_engine import check_vllm_arguments, generate_batch
from calculator import calculate
from generator import AsyncGeneration


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

    sft_model_path: str = "assets/tiny_tools/sft"
    """policy and reference model: a local directory or a hub id"""
    reward_model_path: Optional[str] = None
    """reward model (AutoModelForSequenceClassification with one label) used for training; not loaded with --rule-reward"""
    gold_reward_model_path: Optional[str] = None
    """optional reward model used only for evaluation (eval/gold_scores); None to skip; not loaded with --rule-reward"""
    rule_reward: Optional[str] = "last_number"
    """score with a rule instead of a reward model: `last_number` (GSM8K's: 1 if the response's last number is the answer, else 0)"""
    answer_column: str = "answer"
    """with --rule-reward: the dataset column holding each prompt's answer"""
    trust_remote_code: bool = False
    """allow models and tokenizers to run code from their repository"""
    dataset_name: str = "assets/tiny_tools/data"
    """dataset whose prompts are a `query` column of text or a `messages` column of chats: a local directory or a hub id"""
    dataset_train_split: str = "train"
    """split to train on"""
    dataset_eval_split: str = "test"
    """split to evaluate on"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens keep their last max_prompt_length tokens"""
    response_length: int = 32
    """the most tokens of an episode, the policy's turns and the environment's results together"""
    temperature: float = 0.7
    """sampling temperature; training log-probabilities use the same temperature"""
    stop_token: str = "eos"
    """a response ends at its first stop token: `eos` for the tokenizer's EOS, or a string that is one token"""
    missing_eos_penalty: float = -1.0
    """score penalty for a response that has no stop token (see --missing-eos-mode)"""
    missing_eos_mode: Literal["add", "replace"] = "add"
    """`add` the penalty to the score of a response without a stop token (TRL), or `replace` its score by it (the paper's code)"""

    total_episodes: int = 16_000
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

    # Algorithm specific arguments
    k: int = 4
    """responses sampled per prompt"""
    loss_type: Literal["grpo", "dr_grpo", "dapo", "gspo", "cispo"] = "grpo"
    """the objective: `grpo`, `dr_grpo`, `dapo`, `gspo` or `cispo` (the module's docstring, grpo_policy_loss()); --beta, --cliprange-low and --cliprange-high default to what its paper ran"""
    beta: Optional[float] = None
    """weight of the KL to the reference in the loss (default by --loss-type: grpo 0.04, the others 0)"""
    cliprange_low: Optional[float] = None
    """the ratio is clipped below at 1 - cliprange_low (default by --loss-type: 0.2, gspo 3e-4; cispo has no lower clip)"""
    cliprange_high: Optional[float] = None
    """the ratio is clipped above at 1 + cliprange_high (default by --loss-type: 0.2, dapo 0.28, gspo 4e-4, cispo 4: its weight's cap of 5)"""
    is_cap: float = 2.0
    """off-policy correction: weight the loss by pi_prox / pi_behaviour, truncated at (or, with --is-mode mask, zero above) this value; 0 turns it off"""
    is_level: Literal["token", "sequence", "geometric"] = "token"
    """the importance weight per `token`, per response (`sequence`: the product of its token ratios) or per response as the `geometric` mean of its token ratios (robust on long responses); default RLOO's sequence, PPO's and GRPO's token"""
    is_mode: Literal["truncate", "mask"] = "truncate"
    """`truncate` the weight at --is-cap, or `mask`: a weight above it becomes 0 (the token or response leaves the loss)"""

    # The environment: a calculator
    max_turns: int = 3
    """the most turns of the policy in an episode: one that ends with a call at this turn ends the episode unanswered"""
    tool_call: str = "<calc>{}</calc>"
    """how the policy calls the calculator, `{}` standing for the expression; what follows `{}` must be one token (a turn ends at it)"""
    tool_result: str = "<result>{}</result>"
    """how the environment appends the result (or `error`), `{}` standing for it; what follows `{}` must be one token (the final turn starts after it)"""

    # Asynchronous generation (vLLM)
    off_policy_steps: int = 1
    """K: each batch is generated by the policy of K updates before the one it trains (the generator runs K ahead)"""
    sync: bool = False
    """on-policy: generate each batch with the newest policy, taking turns with training (for comparison)"""
    generation: Literal["batch", "streaming"] = "batch"
    """`batch`: vLLM generates each batch whole, by the one policy version K updates behind; `streaming`: vLLM never waits for a batch to end, prompts enter as responses finish, each new version loads between decoding steps (a response may hold tokens of several versions, each token's known), and K bounds every token's staleness"""
    max_in_flight: Optional[int] = None
    """with --generation streaming: the most requests vLLM generates at once (default: one batch's responses)"""
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
    weight_sync: Optional[Literal["memory", "file"]] = None
    """how each new policy reaches vLLM: `memory` (vLLM's weight transfer: NCCL to a GPU of its own, CUDA IPC on one it shares; the default on GPUs) or `file` (a save_pretrained directory, in /dev/shm if it has room, that vLLM reloads; the default on a CPU)"""
    check_weights_every: int = 10
    """check that vLLM holds the learner's weights (log-probabilities of a probe, digests of parameters) when it starts, after the first hand-off and every this many updates; stop with one line if not (0: never)"""

    # LoRA (--lora-rank 0: full fine-tuning)
    lora_rank: int = 0
    """train a LoRA adapter of this rank instead of every weight: the reference is the model with the adapter off, and a *_vllm.py hands vLLM only the adapter"""
    lora_alpha: float = 32.0
    """LoRA's scale: the adapter's output is multiplied by lora_alpha / lora_rank"""
    lora_dropout: float = 0.0
    """dropout on the adapter's input: 0 only (sampling runs without dropout, so any other value makes a policy's ratio to itself differ from 1)"""
    lora_target_modules: str = "all-linear"
    """the linear layers that get an adapter: all-linear (every one but the output layer) or names, such as q_proj,v_proj"""

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
# The algorithm: its own functions (some, such as the importance weights, shared with scripts of its family). To
# try a new loss, change these and steps 3-4 of the loop in main(), which follows them.
# ===========================================================================================================


def loss_defaults(loss_type):
    """What each loss type runs with when an argument is not given: its paper's settings. GSPO clips its sequence ratio
    at 3e-4 / 4e-4, since a mean of log-ratios moves far less than a token's; CISPO caps its weight at 5 (ScaleRL) and
    has no lower clip. (DAPO's overlong shaping is left out here: an episode's length is the environment's too.)"""
    beta, low, high = {"grpo": (0.04, 0.2, 0.2), "dr_grpo": (0.0, 0.2, 0.2), "dapo": (0.0, 0.2, 0.28),
                       "gspo": (0.0, 3e-4, 4e-4), "cispo": (0.0, None, 4.0)}[loss_type]
    return {"beta": beta, "cliprange_low": low, "cliprange_high": high}


def group_advantages(scores, k, scale=True):
    """Each response's score minus the mean score of its group (the k responses to its prompt), divided by the group's
    standard deviation (+ 1e-4) when `scale` (not in Dr. GRPO: it weights prompts that are nearly always solved, or
    nearly never, above the others). `scores` holds k blocks of the same prompts: index j * num_prompts + i is sample
    j of prompt i."""
    scores = scores.view(k, -1)
    advantages = scores - scores.mean(0, keepdim=True)
    if scale:
        advantages = advantages / (scores.std(0, keepdim=True) + 1e-4)
    return advantages.flatten()


def groups_of_equal_rewards(rewards, k):
    """Per response, whether its group's rewards are all equal, in the layout of group_advantages(). DAPO tests the
    reward before shaping and penalties (its accuracy, Eq. 11): a group that differs only in length says nothing about
    which answer is right, and normalised, a length penalty of 0.05 would weigh as much as a wrong answer."""
    rewards = rewards.view(k, -1)
    return (rewards.amax(0) == rewards.amin(0)).repeat(k)


def grpo_policy_loss(new_logprobs, old_logprobs, ref_logprobs, advantages, mask, loss_type, cliprange_low,
                     cliprange_high, beta, response_length, mean_tokens, is_weights):
    """The loss of one micro-batch by --loss-type, from per-token log-probabilities (B x T, `mask`: response tokens) under
    the policy, the proximal policy (`old_logprobs`: before this update) and the reference; `mean_tokens`: the mean count
    of response tokens per micro-batch of this mini-batch on every rank (DAPO's and CISPO's mean is the mini-batch's).
    Only each token's policy term is weighted by its importance weight (the off-policy correction), as in TRL: the KL
    term pulls every token, masked ones too. Returns (loss, and per token: the log-ratio to the proximal policy, the
    ratio used (GSPO: its response's), whether it was clipped)."""
    log_ratio = (new_logprobs - old_logprobs) * mask
    if loss_type == "gspo":  # one ratio per response: exp of the mean of its tokens' log-ratios
        ratio = torch.exp(log_ratio.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).expand_as(mask)
    else:
        ratio = torch.exp(log_ratio)
    advantages = advantages.unsqueeze(1)
    if loss_type == "cispo":  # REINFORCE on every token, weighted by its clipped ratio (a constant)
        per_token = -ratio.clamp(max=1 + cliprange_high).detach() * advantages * new_logprobs
        clipped = ratio > 1 + cliprange_high
    else:  # PPO's pessimistic clipped surrogate
        surrogate = advantages * ratio
        clipped_surrogate = advantages * ratio.clamp(1 - cliprange_low, 1 + cliprange_high)
        per_token = -torch.min(surrogate, clipped_surrogate)
        clipped = clipped_surrogate < surrogate
    per_token = per_token * is_weights
    if beta:  # KL(pi || ref) per token, k3 estimate: ref/pi - log(ref/pi) - 1, unbiased and never negative
        log_ref_ratio = ref_logprobs - new_logprobs
        per_token = per_token + beta * (torch.exp(log_ref_ratio) - log_ref_ratio - 1)
    per_token = per_token * mask
    if loss_type in ("grpo", "gspo"):  # the mean over each response's tokens, then over responses
        loss = (per_token.sum(1) / mask.sum(1).clamp(min=1)).mean()
    elif loss_type == "dr_grpo":  # no length normalisation: a sum over tokens divided by a constant
        loss = per_token.sum() / (len(per_token) * response_length)
    else:  # dapo, cispo: one mean over every token of the mini-batch, a long response counting as its length
        loss = per_token.sum() / max(mean_tokens, 1.0)
    return loss, log_ratio, ratio, clipped & mask


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


def generating_version(update, first_version, off_policy_steps):
    """The paper's schedule: the policy version that generates batch `update` (version v is the policy after v
    updates) is the one off_policy_steps (K) updates before the version that trains on it, never one before the run
    started. The generator waits for that exact version, so staleness is the schedule's, not the timing's."""
    return max(first_version, update - 1 - off_policy_steps)


def main(args):
    """The run: set-up (distributed, data, models, DeepSpeed, vLLM and its generator on rank 0), then the loop."""
    args.world_size = int(os.environ.get("WORLD_SIZE", "1"))
    validate(args)
    rank, device = set_up_distributed(args)
    if not torch.cuda.is_available():  # vLLM gets --vllm-cpu-cores of its own; the learner ranks share the others
        torch.set_num_threads(max(1, (len(os.sched_getaffinity(0)) - args.vllm_cpu_cores) // args.world_size))
    prompts_per_rank = args.local_batch_size // args.k
    tokenizer, stop_id, train_prompts, eval_prompts, train_answers, eval_answers = load_data(args, prompts_per_rank)
    calculator = make_calculator(args, tokenizer, stop_id)  # the environment, checked against the tokenizer
    # The learner's episodes to evaluate (play), the rule on final answers (score); vLLM's: AsyncGeneration's below.
    play, score = (functools.partial(f, calculator) for f in (generate_episodes, score_episodes))
    run_name, run_dir = run_directory(args)

    # Models and DeepSpeed engines: the policy trains (AdamW, the learning rate decayed linearly to zero); the
    # reference and reward models only run forward (frozen_engine: partitioned under ZeRO-3, else replicated).
    model = load_model(args, args.sft_model_path, trained=True)
    if args.lora_rank:  # only a LoRA adapter trains; the reference is this model with the adapter off (step 2)
        model = with_lora(args, model)
    config = ds_config(args, train=True)  # --deepspeed-config with this run's batch sizes and precision
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = adam_class(config)(trained, lr=args.learning_rate, eps=1e-5, weight_decay=0.0)
    num_steps = args.num_updates * args.num_mini_batches * args.num_ppo_epochs  # the learning rate decays to 0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 - step / num_steps)
    policy = deepspeed.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler, config=config)[0]
    ref_policy = None if args.lora_rank else frozen_engine(args, load_model(args, args.sft_model_path))
    reward_model = frozen_engine(args, load_model(args, args.reward_model_path, reward=True))
    gold_model = frozen_engine(args, load_model(args, args.gold_reward_model_path, reward=True))

    start_update, episode = 0, 0
    if args.resume:
        start_update, episode = load_checkpoint(latest_checkpoint(args.resume), {"policy": policy})

    # The asynchrony, one object: vLLM on rank 0 and its generator thread, each batch generated by the policy version
    # generating_version() names, K = --off-policy-steps behind (0 with --sync); streaming, episodes turn by turn.
    generation = AsyncGeneration(args, policy, run_dir, train_prompts, schedule=generating_version,
                                 sample=functools.partial(turn_request, calculator), choose_prompts=batch_prompts,
                                 rollout=functools.partial(rollout, calculator, args),
                                 environment=functools.partial(environment_step, calculator))

    run_log = RunLog(args, run_dir, run_name, start_update, episode)  # metrics.jsonl, wandb, the console
    if rank == 0:  # with the values in force of the arguments whose default is the loss type's
        print(f"run {run_dir}: {args.num_updates} updates of {args.batch_size} episodes; --loss-type {args.loss_type}, "
              + ", ".join(f"--{n.replace('_', '-')} {getattr(args, n)}" for n in loss_defaults(args.loss_type)))

    pad = tokenizer.pad_token_id
    if not args.resume:  # the curves start from the SFT policy
        eval_metrics, samples = evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer,
                                         stop_id, device, play, truncate_response, score)
        run_log.log(0, {**eval_metrics, "episode": 0}, samples)
    start_time, start_episode = time.time(), episode
    for update in range(start_update + 1, args.num_updates + 1):
        # 1. Take the next batch from the generator: k episodes per prompt, generated by policy `batch.version`.
        t0 = time.time()
        batch = generation.get()
        indices = batch.prompts[rank]  # this rank's prompts, as batch_prompts() chose them for vLLM
        queries = left_pad([train_prompts[i] for i in indices], pad, device).repeat(args.k, 1)
        answers = [train_answers[i] for i in indices] * args.k  # the k blocks of queries
        context_length = queries.shape[1]
        responses = truncate_response(right_pad(batch.responses[rank], pad, device), stop_id, pad)
        query_responses = torch.cat([queries, responses], 1)
        # The policy's tokens: not the environment's (context it read, as appended), not the padding after the episode.
        policy_tokens = (responses != pad) & (right_pad(batch.sampled[rank], 1, device) == 1)
        behaviour_logprobs = right_pad(batch.logprobs[rank], 0.0, device).masked_fill(~policy_tokens, 0.0)
        t1 = time.time()

        # 2. Score: log-probabilities under the policy and the reference, reward-model scores. When the batch is
        #    trained on in one step (one epoch, one micro-batch), the ratio to the proximal policy (the learner's
        #    before the update) is exactly 1: its log-probabilities come from that step's forward, run here.
        whole_batch_step = args.num_ppo_epochs == 1 and args.per_device_train_batch_size == args.local_batch_size
        logprobs, ref_logprobs, scores = [], [], []
        if whole_batch_step:
            batch_logits = response_logits(policy, query_responses, pad, context_length)  # step 4 trains on these
            logprobs.append(response_logprobs(batch_logits, responses, args.temperature).detach())
        with torch.no_grad():
            for i in range(0, len(query_responses), args.per_device_train_batch_size):
                chunk = query_responses[i: i + args.per_device_train_batch_size]
                chunk_responses = chunk[:, context_length:]
                if not whole_batch_step:
                    logprobs.append(response_logprobs(response_logits(policy, chunk, pad, context_length),
                                                      chunk_responses, args.temperature))
                with reference_model(policy, ref_policy) as reference:  # with LoRA: the policy, its adapter off
                    ref_logprobs.append(response_logprobs(response_logits(reference, chunk, pad, context_length),
                                                          chunk_responses, args.temperature))
                scores.append(score(args, reward_model, chunk, context_length,
                                    answers[i: i + args.per_device_train_batch_size], tokenizer))
        logprobs = torch.cat(logprobs).masked_fill(~policy_tokens, 0.0)
        ref_logprobs = torch.cat(ref_logprobs).masked_fill(~policy_tokens, 0.0)
        raw_scores = torch.cat(scores)
        scores = apply_missing_eos_penalty(raw_scores, responses, stop_id, args.missing_eos_penalty,
                                           args.missing_eos_mode)

        # 3. Group-normalised advantages of the scores (the KL to the reference is in the loss); the tokens the loss
        #    counts: the policy's, and with dapo not those of groups of equal rewards (advantages 0, docs/grpo_vllm.md).
        #    The off-policy correction: each token's importance weight pi_prox / pi_behaviour (the learner's over
        #    vLLM's probability; per response with --is-level sequence or geometric), truncated at --is-cap (or masked).
        kl = (logprobs - ref_logprobs).sum(1)
        advantages = group_advantages(scores, args.k, scale=args.loss_type != "dr_grpo")
        equal = groups_of_equal_rewards(raw_scores, args.k)
        mask = policy_tokens & ~equal.unsqueeze(1) if args.loss_type == "dapo" else policy_tokens
        is_weights, is_stats = importance_weights(logprobs, behaviour_logprobs, policy_tokens, args.is_cap,
                                                  args.is_level, args.is_mode)
        is_weights = is_weights.view(len(logprobs), -1).expand_as(logprobs)  # a response's weight on each token
        t2 = time.time()

        # 4. Clipped, importance-weighted updates over mini-batches of this batch (grpo_policy_loss() by --loss-type).
        stats = {name: [] for name in ("loss", "approxkl", "clipfrac", "ratio", "entropy")}
        local_mini_batch = args.local_batch_size // args.num_mini_batches
        for _ in range(args.num_ppo_epochs):
            order = torch.randperm(args.local_batch_size, device=device)
            for mini_start in range(0, args.local_batch_size, local_mini_batch):
                tokens = mask[order[mini_start: mini_start + local_mini_batch]].sum().double()
                dist.all_reduce(tokens)  # the mini-batch's response tokens on every rank
                mean_tokens = tokens.item() / (args.world_size * args.gradient_accumulation_steps)
                for micro_start in range(mini_start, mini_start + local_mini_batch, args.per_device_train_batch_size):
                    idx = order[micro_start: micro_start + args.per_device_train_batch_size]
                    logits = (batch_logits[idx] if whole_batch_step
                              else response_logits(policy, query_responses[idx], pad, context_length))
                    new_logprobs = response_logprobs(logits, responses[idx], args.temperature)
                    new_logprobs = new_logprobs.masked_fill(~policy_tokens[idx], 0.0)
                    loss, log_ratio, ratio, clipped = grpo_policy_loss(
                        new_logprobs, logprobs[idx], ref_logprobs[idx], advantages[idx], mask[idx], args.loss_type,
                        args.cliprange_low, args.cliprange_high, args.beta, args.response_length, mean_tokens,
                        is_weights[idx])
                    policy.backward(loss)
                    policy.step()
                    with torch.no_grad():
                        entropy = entropy_from_logits(logits / args.temperature)
                        stats["loss"].append(loss)
                        stats["approxkl"].append(0.5 * masked_mean(log_ratio ** 2, mask[idx]))
                        stats["clipfrac"].append(masked_mean(clipped.float(), mask[idx]))
                        stats["ratio"].append(masked_mean(ratio, mask[idx]))
                        stats["entropy"].append(masked_mean(entropy, policy_tokens[idx]))
        logits = batch_logits = None  # batch x response length x vocabulary: not held through the steps that follow
        get_accelerator().synchronize()  # a GPU may still run the optimizer's step: it counts as training
        # Weights or outputs that became inf or NaN stop the run here, before they are used or saved.
        stop_if_diverged({"policy": policy}, eval_prompts[0], update, run_dir, args.learning_rate)
        t3 = time.time()

        # 5. Hand the new weights to vLLM, if a later batch is to be generated by them.
        waited = generation.hand_over(policy, update)  # seconds waiting for the generator's older batches: idle
        t4 = time.time()

        # 6. Log, evaluate, save.
        episode += args.batch_size
        step_means = {name: torch.stack(per_step).mean().item() for name, per_step in stats.items()}
        metrics = mean_over_ranks({
            "objective/scores": scores.mean().item(),
            "objective/raw_scores": raw_scores.mean().item(),
            "objective/kl": proximal_mean(kl, logprobs, behaviour_logprobs, policy_tokens),
            "objective/equal_score_groups": equal.float().mean().item(),
            "objective/entropy": (-logprobs).sum(1).mean().item(),
            "policy/entropy_avg": step_means["entropy"],
            "loss/policy_avg": step_means["loss"],
            "policy/approxkl_avg": step_means["approxkl"],
            "policy/clipfrac_avg": step_means["clipfrac"],
            "val/ratio": step_means["ratio"],
            "val/ratio_var": torch.stack(stats["ratio"]).var().item() if len(stats["ratio"]) > 1 else 0.0,
            "val/num_eos_tokens": (responses == stop_id).sum().item() * args.world_size,
            "val/response_length": policy_tokens.sum(1).float().mean().item(),  # the policy's tokens of an episode
            **tool_metrics(calculator, batch.responses[rank], batch.sampled[rank], raw_scores),
            "async/off_policy_steps": update - 1 - batch.version,
            **batch.stream_metrics(update),  # (streaming: the versions of its tokens)
            "async/mismatch_kl": mismatch_kl(logprobs, behaviour_logprobs, policy_tokens),
            **is_stats,
            "time/vllm_generation": batch.generation_time,
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
                                             stop_id, device, play, truncate_response, score)
            metrics.update(eval_metrics)
        run_log.log(update, metrics, samples, phases={"take the batch": t0, "score": t1, "train": t2,
                                                      "hand over": t3, "log": t4})
        if (args.save_every and update % args.save_every == 0) or update == args.num_updates:
            # (with the batches already generated for the next K updates: a resumed run trains on them)
            save_checkpoint(args, run_dir, update, episode, {"policy": policy},
                            extra_files=generation.checkpoint_files(update))

    generation.close()
    run_log.close()
    dist.barrier()
    dist.destroy_process_group()


# ===========================================================================================================
# This script's argument checks (checks.py holds those of every script), then the RLHF details the loop computes
# with, the same in every script on purpose (tests/test_layout.py): sampling, log-probabilities at the sampling
# temperature, truncation at the stop token, reward scoring and the rule reward, the missing-EOS penalty.
# ===========================================================================================================

def validate(args):
    """Check the arguments before any model is loaded; fill in the derived batch sizes."""
    check_gpu_driver()
    if args.loss_type == "cispo" and args.cliprange_low is not None:
        fail("cliprange_low", "cispo has no lower clip: its weight is only capped, at 1 + --cliprange-high")
    for name, value in loss_defaults(args.loss_type).items():
        if getattr(args, name) is None:  # what the loss type's paper ran; a value passed wins
            setattr(args, name, value)
    lower = () if args.loss_type == "cispo" else ("cliprange_low",)
    check_bounds(args, positive=("cliprange_high", "generation_timeout", "max_turns"),
                 at_least_0=("beta", "is_cap", "check_weights_every"), lower_clips=lower)
    if args.k < 2:
        fail("k", f"a group needs at least 2 responses per prompt, got {args.k}")
    check_vllm_arguments(args)
    check_batch_sizes(args)
    if args.local_batch_size % args.k:
        fail("k", f"must divide the per-device batch of {args.local_batch_size} responses "
                       "(per_device_train_batch_size x gradient_accumulation_steps x num_mini_batches)")
    for name, parts in (("tool_call", args.tool_call.split("{}")), ("tool_result", args.tool_result.split("{}"))):
        if len(parts) != 2 or not parts[1] or not parts[0] and name == "tool_call":
            fail(name, f"must hold one `{{}}` with text after it (a call, also before), got {getattr(args, name)!r}")
    for name in ("reward_model_path", "gold_reward_model_path") if args.rule_reward else ():
        if getattr(args, name) is not None:  # (a path the rule would leave unread)
            fail(name, f"--rule-reward {args.rule_reward} scores the episodes: no reward model (--rule-reward None)")
    check_run(args, RULE_REWARDS)
    check_lora(args)
    check_resume(args)


@torch.no_grad()
def generate(model, queries, pad_token_id, stop_token_id, response_length, temperature=None):
    """Sample (or, with temperature None, greedily decode) responses to left-padded queries: HF generate()'s loop (the
    same tokens for the same seed) with a preallocated KV cache and without its per-step machinery (logits processors,
    stopping criteria), which costs more than a small model's arithmetic. After its stop token a response gets
    padding; the loop ends when all have one. Padded positions read token 0 (see data.load_tokenizer)."""
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


def forward(model, query_responses, pad_token_id, **model_kwargs):
    """Run a model on left-padded queries followed by right-padded responses (and `model_kwargs`); padded positions
    are masked and read token 0 (the pad id may lie outside the model's vocabulary, see data.load_tokenizer)."""
    attention_mask = query_responses != pad_token_id
    position_ids = (attention_mask.cumsum(1) - 1).clamp(min=0)
    return model(input_ids=query_responses.masked_fill(~attention_mask, 0), attention_mask=attention_mask,
                 position_ids=position_ids, use_cache=False, **model_kwargs)


def response_logits(model, query_responses, pad_token_id, context_length):
    """The logits that predict the response tokens (at positions context_length - 1 to the one before last). The
    language-model head runs on those positions alone (`logits_to_keep` counts from the end): nothing reads the
    prompt's logits, which on long prompts are most of a pass's work and memory."""
    response_length = query_responses.shape[1] - context_length
    return forward(model, query_responses, pad_token_id, logits_to_keep=response_length + 1).logits[:, :-1]


def response_logprobs(logits, responses, temperature):
    """Log-probabilities of the response tokens under their logits (response_logits) divided by the sampling
    temperature: each token's logit minus the log-sum-exp, with no log-softmax over the vocabulary kept per position.
    Padding gets a number that callers mask: its id may lie past the vocabulary (data.load_tokenizer), so it reads
    the last row."""
    logits = logits.float() / temperature
    tokens = responses.clamp(max=logits.shape[-1] - 1)
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, -1)


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


def sampling_params(response_length, stop_token_ids, temperature, seed):
    """vLLM's request for one turn: `response_length` tokens at `temperature` (0: greedy) and the log-probability
    of each token under the weights that sampled it (the behaviour policy), at that temperature. Only the stop token or
    the call's end (`stop_token_ids`) ends a turn (and is kept). Each request has a seed of its own, never repeated in a
    run, so that a batch depends on the weights and seeds only, not on what vLLM generated before (which keeps reruns
    and resumed runs exact)."""
    from vllm import SamplingParams

    return SamplingParams(temperature=temperature, top_k=0, top_p=1.0, max_tokens=response_length, ignore_eos=True,
                          stop_token_ids=list(stop_token_ids), seed=seed, logprobs=0,
                          detokenize=False)  # token ids are all we use: no text decoded in this process


def batch_prompts(args, num_prompts, prompts_per_rank, batch):
    """Each rank's prompts (indices) in generation batch `batch` (1, 2, ...): shuffled epochs without repeats, split
    between the ranks. vLLM generates for them and step 1 trains on them (the batch carries them): a curriculum or a
    prompt filter goes here."""
    return [prompt_batch(num_prompts, prompts_per_rank, batch - 1, args.seed, rank, args.world_size)
            for rank in range(args.world_size)]


# ===========================================================================================================
# The environment, a calculator, an RLHF detail of this script: from the prompt, after each turn of the policy, the ids
# to append (environment_step()) or the end; the rule's reward on the final answer (score_episodes()).
# ===========================================================================================================

Calculator = NamedTuple("Calculator", [(name, object) for name in (  # the environment's settings (make_calculator)
    "tokenizer", "call_start", "call_end", "call_end_id", "result", "result_end_id", "error_ids", "stop_id", "turns")])


def make_calculator(args, tokenizer, stop_id):
    """The Calculator of --tool-call, --tool-result and --max-turns; one line naming the argument if the tokenizer
    cannot end a call or a result with one token."""
    (call_start, call_end), result_end = args.tool_call.split("{}"), args.tool_result.split("{}")[1]
    ends = [tokenizer.encode(end, add_special_tokens=False) for end in (call_end, result_end)]
    for name, end, ids in zip(("tool_call", "tool_result"), (call_end, result_end), ends):
        if len(ids) != 1:
            fail(name, f"{end!r} is {len(ids)} tokens of the policy's tokenizer, not one (a turn or result ends at it)")
    return Calculator(tokenizer, call_start, call_end, ends[0][0], args.tool_result, ends[1][0], tokenizer.encode(
        args.tool_result.format("error"), add_special_tokens=False), stop_id, args.max_turns)


def environment_step(env, turn, turns, room):
    """After the policy's `turns`-th turn (its ids): the ids to append and whether the episode ends. A call gets the
    calculator's result (`error` for a malformed one), cut to the `room` left; any other turn ends the episode (the stop
    token: a final answer; neither: --response-length is spent), and so does a call at the last of --max-turns."""
    if not turn or turn[-1] != env.call_end_id or turns == env.turns:
        return [], True
    text = env.tokenizer.decode(turn)  # read only: the episode keeps vLLM's ids
    start = text.rfind(env.call_start)
    value = calculate(text[start + len(env.call_start): text.rfind(env.call_end)]) if start >= 0 else None
    result = env.tokenizer.encode(env.result.format("error" if value is None else value), add_special_tokens=False)
    return result[:room], len(result) >= room


def play_episodes(env, prompts, response_length, sample_turns):
    """Episodes from `prompts` (ids), each turn of the live ones at once: sample_turns(contexts, live, rooms, turn) gives
    each its turn's ids and log-probabilities (contexts: prompt and episode so far, as sampled and appended; live: their
    indices; rooms: the tokens each may still take), then environment_step(). Returns each episode's ids,
    log-probabilities (0 for the environment's) and per token 1 if the policy sampled it, 0 if it was appended."""
    ids, logprobs, sampled = ([[] for _ in prompts] for _ in range(3))
    live = list(range(len(prompts)))
    for turn in range(1, env.turns + 1):
        rooms = [response_length - len(ids[n]) for n in live]
        still = []
        for n, room, (tokens, token_logprobs) in zip(live, rooms, sample_turns([prompts[n] + ids[n] for n in live],
                                                                               live, rooms, turn)):
            result, done = environment_step(env, tokens, turn, room - len(tokens))
            ids[n] += tokens + result
            logprobs[n] += token_logprobs + [0.0] * len(result)
            sampled[n] += [1] * len(tokens) + [0] * len(result)
            still += [] if done else [n]
        if not still:
            break
        live = still
    return list(zip(ids, logprobs, sampled))


def turn_request(env, room, stop_id, temperature, seed):
    """vLLM's request for a turn of at most `room` tokens: it ends at the stop token or at the call's end."""
    return sampling_params(room, (stop_id, env.call_end_id), temperature, seed)


def rollout(env, args, llm, prompts, k, seed, adapter):
    """k episodes of each prompt (episode j of prompt i at j * len(prompts) + i), each turn of them in vLLM. Request n's
    turn t (from 1) has seed seed + n + (t - 1) * 2**44: turn 1's as batch mode's, later ones' past every run seed."""
    def sample_turns(contexts, live, rooms, turn):
        return generate_batch(llm, contexts, 1, lambda i: turn_request(
            env, rooms[i], env.stop_id, args.temperature, seed + live[i] + (turn - 1) * 2**44), adapter)

    return play_episodes(env, [prompt for _ in range(k) for prompt in prompts], args.response_length, sample_turns)


@torch.no_grad()
def generate_episodes(env, model, queries, pad_token_id, stop_token_id, response_length, temperature=None):
    """Episodes of left-padded queries with the learner's model (evaluation's, greedy), right-padded: each turn by
    generate() to the call's end, cut at the first stop token (generate() stops at one token)."""
    def sample_turns(contexts, live, rooms, turn):
        turns = generate(model, left_pad(contexts, pad_token_id, queries.device), pad_token_id, env.call_end_id,
                         max(rooms), temperature).tolist()
        cut = []
        for tokens, room in zip(turns, rooms):
            ends = [i for i, t in enumerate(tokens[:room]) if t in (stop_token_id, env.call_end_id, pad_token_id)]
            cut.append(tokens[: ends[0] + (tokens[ends[0]] != pad_token_id)] if ends else tokens[:room])
        return [(tokens, [0.0] * len(tokens)) for tokens in cut]

    prompts = [query[query != pad_token_id].tolist() for query in queries]
    return right_pad([ids for ids, _, _ in play_episodes(env, prompts, response_length, sample_turns)], pad_token_id,
                     queries.device)


@torch.no_grad()
def score_episodes(env, args, reward_model, query_responses, context_length, answers, tokenizer):
    """score_responses() on episodes: the rule reads the final answer, what follows the last result, of an episode that
    ended with the stop token (of any other, nothing: 0); a reward model scores the whole episode."""
    if args.rule_reward is not None:
        responses = query_responses[:, context_length:]
        after_results = (responses == env.result_end_id).long().flip(1).cumsum(1).flip(1) == 0
        answered = (responses == env.stop_id).any(1, keepdim=True)
        query_responses = torch.cat([query_responses[:, :context_length],
                                     responses.masked_fill(~(after_results & answered), tokenizer.pad_token_id)], 1)
    return score_responses(args, reward_model, query_responses, context_length, answers, tokenizer)


def tool_metrics(env, responses, sampled, scores):
    """tools/, per episode of this rank: the policy's turns, calls, malformed calls (an error result), the share ended at
    --max-turns on a call, the environment's tokens, the share with a call, the raw score of those with and without."""
    stats = []
    for ids, own in zip(responses, sampled):
        starts = [i for i in range(len(own)) if own[i] and (i == 0 or not own[i - 1])]
        results = [ids[i: i + len(env.error_ids)] for i in range(len(own)) if not own[i] and own[i - 1]]
        calls = sum(t == env.call_end_id and o for t, o in zip(ids, own))
        stats.append([len(starts), calls, results.count(env.error_ids),
                      len(starts) == env.turns and ids[-1] == env.call_end_id, len(own) - sum(own), calls > 0])
    turns, calls, errors, limit, appended, used = torch.tensor(stats, dtype=torch.float64, device=scores.device).T
    return {"tools/turns": turns.mean().item(), "tools/calls": calls.mean().item(),
            "tools/errors": errors.mean().item(), "tools/turn_limit": limit.mean().item(),
            "tools/environment_tokens": appended.mean().item(), "tools/tool_rate": used.mean().item(),
            "tools/accuracy_with_tool": (scores * used).sum().item() / max(used.sum().item(), 1),
            "tools/accuracy_without_tool": (scores * (1 - used)).sum().item() / max((1 - used).sum().item(), 1)}


if __name__ == "__main__":
    main(parse_arguments(Args))
