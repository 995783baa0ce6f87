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

import os
import re
import time
from dataclasses import dataclass
from typing import Literal, Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import deepspeed
import torch.distributed as dist
import torch.nn.functional as F
from deepspeed.accelerator import get_accelerator
from transformers import StaticCache

from checks import check_bounds, check_gpu_driver, check_lora, check_run, fail, parse_arguments, check_batch_sizes
from data import left_pad, load_data, load_model, prompt_batch, with_lora
from distributed import (adam_class, ds_config, frozen_engine, mean_over_ranks, reference_model, set_up_distributed,
                         unwrapped_for_generation)
from checkpoints import check_resume, latest_checkpoint, load_checkpoint, save_checkpoint, stop_if_diverged
from runlog import RunLog, run_directory
from held_out import evaluate


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
    missing_eos_mode: Literal["add", "replace"] = "add"
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

    # Algorithm specific arguments
    k: int = 2
    """responses sampled per prompt"""
    beta: float = 0.1
    """strength of the implicit KL constraint to the reference (DPO's beta)"""
    loss_type: Literal["sigmoid", "ipo"] = "sigmoid"
    """`sigmoid` (DPO) or `ipo` (IPO)"""

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

    run_log = RunLog(args, run_dir, run_name, start_update, episode)  # metrics.jsonl, wandb, the console
    if rank == 0:
        print(f"run {run_dir}: {args.num_updates} updates of {args.batch_size} responses "
              f"({args.batch_size // args.k} prompts x {args.k})", flush=True)

    pad = tokenizer.pad_token_id
    if not args.resume:  # the curves start from the SFT policy
        eval_metrics, samples = evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer,
                                         stop_id, device, generate, truncate_response, score_responses)
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
                with reference_model(policy, ref_policy) as reference:  # with LoRA: the policy, its adapter off
                    ref_logprobs.append(response_logprobs(response_logits(reference, chunk, pad, context_length),
                                                          chunk[:, context_length:], args.temperature))
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
            for mini_start in range(0, num_prompts, mini_batch_prompts):
                for micro_start in range(mini_start, mini_start + mini_batch_prompts, micro_batch_prompts):
                    prompts = order[micro_start: micro_start + micro_batch_prompts]
                    idx = torch.cat([chosen[prompts], rejected[prompts]])  # chosen first, then rejected
                    logits = response_logits(policy, query_responses[idx], pad, context_length)
                    new_logprobs = response_logprobs(logits, responses[idx], args.temperature)
                    new_logprobs = new_logprobs.masked_fill(padding_mask[idx], 0.0).sum(1)
                    new_logratios = new_logprobs - ref_logprobs[idx].sum(1)
                    chosen_logratios, rejected_logratios = new_logratios.chunk(2)
                    loss = dpo_loss(chosen_logratios, rejected_logratios, args.beta, args.loss_type)
                    policy.backward(loss)
                    policy.step()
                    with torch.no_grad():
                        entropy = entropy_from_logits(logits / args.temperature)
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
        logits = None  # batch x response length x vocabulary: not held through the steps that follow
        get_accelerator().synchronize()  # a GPU may still run the optimizer's step: it counts as training
        # Weights or outputs that became inf or NaN stop the run here, before they are used or saved.
        stop_if_diverged({"policy": policy}, eval_prompts[0], update, run_dir, args.learning_rate)
        t3 = time.time()

        # 5. Log, evaluate, save.
        episode += args.batch_size
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
            # The response tokens the loss took (every process's): the pairs, not the k responses sampled. A pair of
            # equal scores is one response twice, counted twice, as the forward takes it (runlog's trained tokens).
            "val/trained_tokens": (~padding_mask[torch.cat([chosen, rejected])]).sum().item() * args.world_size,
            "time/generation": t1 - t0,
            "time/scoring": t2 - t1,
            "time/training": t3 - t2,
        }, device)
        metrics.update({"lr": policy.get_lr()[0], "episode": episode,
                        "time/episodes_per_second": (episode - start_episode) / (time.time() - start_time)})
        samples = None
        if (args.eval_every and update % args.eval_every == 0) or update == args.num_updates:
            eval_metrics, samples = evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer,
                                             stop_id, device, generate, truncate_response, score_responses)
            metrics.update(eval_metrics)
        run_log.log(update, metrics, samples, phases={"generate": t0, "score": t1, "train": t2, "log": t3})
        if (args.save_every and update % args.save_every == 0) or update == args.num_updates:
            save_checkpoint(args, run_dir, update, episode, {"policy": policy})

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
    check_bounds(args, positive=("beta",))
    if args.k < 2:
        fail("k", f"a pair needs at least 2 responses per prompt, got {args.k}")
    if args.per_device_train_batch_size % args.k:
        fail("k", f"must divide --per-device-train-batch-size ({args.per_device_train_batch_size}): "
                  "a micro-batch holds whole prompts")
    check_batch_sizes(args)
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


if __name__ == "__main__":
    main(parse_arguments(Args))
