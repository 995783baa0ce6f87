"""Evaluate policies as the asynchronous RLHF paper does: gold win rate against reference responses, and
distance from the SFT model.

For every policy checkpoint of a run (or one model path), near-greedy responses (temperature 0.01)
to the held-out prompts are scored by a gold reward model, together with the dataset's reference
responses. Reported per checkpoint:
- win rate: the share of prompts whose response the gold model scores strictly higher than the
  reference (the paper's definition: ties lose);
- gold score: the mean gold score of the responses (and its margin over the references');
- accuracy, instead of both with `--rule-reward last_number` (the math task, the paper's GSM8K
  metric): the share of greedy (`--temperature 0`) responses whose last number is the answer;
- KL: the policy's KL to the SFT model on its own samples, drawn at the training temperature
  (0.7) and summed over response tokens, as the training scripts log objective/kl;
- perplexity: the paper's "KL (perplexity)", the SFT model's perplexity on the evaluated
  responses (per response, exp of the mean negative log-likelihood per token; then averaged).
Responses come from vLLM when it is installed (one engine, whose weights are swapped between
checkpoints) or from HF generation (`--backend hf`). A LoRA checkpoint (`--lora-rank`) is its adapter
merged into `--sft-model-path`'s weights, and evaluated as any other model.

    python evaluate.py --checkpoints runs/online_dpo__1__1700000000      # every checkpoint of a run
    python evaluate.py --checkpoints runs/online_dpo__1__1700000000/checkpoint-1000 --backend hf
    python evaluate.py --checkpoints mnoukhov/pythia410m-sft-tldr --sft-model-path mnoukhov/pythia410m-sft-tldr \\
        --gold-reward-model-path cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr \\
        --dataset-name vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144 \\
        --dataset-eval-split validation --max-prompt-length 512 --response-length 53
    python evaluate.py --checkpoints runs/rloo__1__1700000000 --sft-model-path assets/tiny_math/sft \
        --dataset-name assets/tiny_math/data --rule-reward last_number --temperature 0 --response-length 8
"""

import glob
import importlib.util
import json
import os
import re
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Literal, Optional

import torch
from transformers import AutoTokenizer, StaticCache

from checks import (check_dataset_path, check_gpu_driver, check_model, check_model_path, check_numbers, fail,
                    parse_arguments)
from data import (check_answers, check_chats, check_texts, left_pad, load_model, load_tokenizer, read_dataset,
                  right_pad, stop_token_id)
from vllm_engine import check_vllm_gpu, load_into_vllm, parameter_bytes, shut_down, start_vllm
from weight_handoff import untied_for_vllm, write_for_vllm


@dataclass
class Args:
    """Every argument (vLLM logs warnings only: VLLM_LOGGING_LEVEL=INFO python ... shows its start-up lines)."""

    checkpoints: Optional[str] = None
    """a run directory (every checkpoint-<update> in it is evaluated) or one model directory or hub id"""
    sft_model_path: str = "assets/tiny/sft"
    """policy and reference model: a local directory or a hub id"""
    gold_reward_model_path: Optional[str] = "assets/tiny/gold_reward"
    """gold reward model of the win rate; not loaded with --rule-reward"""
    rule_reward: Optional[str] = None
    """score with a rule instead of a gold model and report accuracy: `last_number` (GSM8K's: 1 if the response's last number is the answer, else 0)"""
    answer_column: str = "answer"
    """with --rule-reward: the dataset column holding each prompt's answer"""
    trust_remote_code: bool = False
    """allow models and tokenizers to run code from their repository"""
    dataset_name: str = "assets/tiny/data"
    """dataset with a `query` column of prompts or a `messages` column of chats: a local directory or a hub id"""
    dataset_eval_split: str = "test"
    """split to evaluate on"""
    reference_column: str = "reference_response"
    """column of the dataset's reference responses (the text after the prompt; a chat without it: its final reply);
    not read with --rule-reward"""
    num_eval_prompts: int = 0
    """evaluate on the first this many prompts of the split (0: all, as the paper)"""
    max_prompt_length: int = 64
    """prompts longer than this many tokens keep their last max_prompt_length tokens"""
    response_length: int = 16
    """number of tokens to sample for each response"""
    temperature: float = 0.01
    """temperature of the evaluated responses (near-greedy, as in the paper's TL;DR; 0: greedy, as for GSM8K)"""
    kl_temperature: float = 0.7
    """temperature of the samples on which the KL to the SFT model is estimated (the training temperature)"""
    stop_token: str = "eos"
    """a response ends at its first stop token: `eos` for the tokenizer's EOS, or a string that is one token"""
    backend: Literal["auto", "vllm", "hf"] = "auto"
    """`vllm`, `hf` (transformers generation), or `auto`: vllm when it is installed"""
    per_device_eval_batch_size: int = 64
    """prompts per HF generation and per forward pass"""
    seed: int = 1
    """random seed"""
    bf16: bool = torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False)
    """train and generate in bfloat16 (default: on when the GPU has it natively, compute capability 8.0 or later)"""
    output: Optional[str] = None
    """JSON file for the results (default: evaluation.json in the run directory, or in the checkpoint)"""
    track: bool = False
    """log to Weights & Biases (set WANDB_MODE=offline to log without a network)"""
    wandb_project_name: str = "async-rlhf"
    """wandb project"""
    wandb_entity: Optional[str] = None
    """wandb entity (team or user)"""
    vllm_gpu: Optional[int] = None
    """GPU for vLLM, as CUDA_VISIBLE_DEVICES numbers it; default: the next GPU after the policy's, else the policy's"""
    vllm_gpu_memory_utilization: Optional[float] = None
    """share of its GPU's memory vLLM may take (default: 0.9 of a GPU of its own, half the free memory of one it shares with training)"""
    vllm_cpu_cores: int = 1
    """without a GPU: CPU cores for vLLM (the learner keeps the others)"""
    vllm_enforce_eager: bool = False
    """skip vLLM's model compilation (and CUDA graphs): starts faster, generates slower; for short runs"""

    # Filled in at run time.
    batch_size: int = 0
    """(set at run time) responses per generation batch on all devices"""


# ===========================================================================================================
# Evaluation's own functions: sampling, scoring and the paper's metrics.
# ===========================================================================================================

def find_checkpoints(path):
    """The checkpoints of a run directory, by update; or `path` itself when it is a model (or a LoRA adapter)."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")) or is_adapter(path):
        return [path]
    updates = sorted(int(d.split("-")[1]) for d in os.listdir(path) if d.startswith("checkpoint-") and d[len("checkpoint-"):].isdigit())
    if not updates:
        runs = [d for d in sorted(os.listdir(path)) if glob.glob(os.path.join(path, d, "checkpoint-*"))]
        hint = f" (it holds runs: pass one, e.g. {os.path.join(path, runs[0])})" if runs else ""
        fail("checkpoints", f"no checkpoint-<update> directory and no model in {path}{hint}")
    return [os.path.join(path, f"checkpoint-{update}") for update in updates]


def is_adapter(checkpoint):
    """A LoRA checkpoint: peft's adapter of the SFT model, without the model's weights."""
    return os.path.isfile(os.path.join(checkpoint, "adapter_config.json"))


def check_adapter(checkpoint):
    """A LoRA checkpoint holds peft's adapter: its config and its weights (its base, --sft-model-path, is checked as a
    model)."""
    try:
        with open(os.path.join(checkpoint, "adapter_config.json")) as f:
            peft_type = json.load(f).get("peft_type")
    except (OSError, ValueError) as error:
        fail("checkpoints", f"cannot read the adapter's config in {checkpoint}: {error}")
    if peft_type != "LORA" or not os.path.isfile(os.path.join(checkpoint, "adapter_model.safetensors")):
        fail("checkpoints", f"{checkpoint} holds no LoRA adapter in peft's format (adapter_config.json of peft_type "
                            "LORA, adapter_model.safetensors)")


def load_policy(args, checkpoint):
    """A checkpoint's policy; a LoRA adapter merged into --sft-model-path's weights (W + BA * alpha / rank): HF and
    vLLM then evaluate one plain model, every checkpoint alike, and vLLM's weights are swapped as for full ones."""
    if not is_adapter(checkpoint):
        return load_model(args, checkpoint)
    from peft import PeftModel

    return PeftModel.from_pretrained(load_model(args, args.sft_model_path), checkpoint).merge_and_unload()


def load_eval_data(args, tokenizer, stop_id):
    """Tokenised prompts of the eval split and, with --rule-reward, their answers, else the reference responses
    (with the stop token appended). A prompt is the `query` column's text, or the `messages` column's chat
    rendered as the training scripts render it; a chat's reference is its final assistant message unless the
    split has a --reference-column."""
    dataset = read_dataset(args)
    if args.dataset_eval_split not in dataset:
        fail("dataset_eval_split", f"dataset {args.dataset_name} has no split {args.dataset_eval_split!r} "
                                   f"(it has {sorted(dataset)})")
    split = dataset[args.dataset_eval_split]
    columns = split.column_names
    if "query" not in columns and "messages" not in columns:
        fail("dataset_name", f"split {args.dataset_eval_split!r} has no `query` or `messages` column (it has {columns})")
    where = f"split {args.dataset_eval_split!r} of {args.dataset_name}"
    chats = None if "query" in columns else check_chats(list(split["messages"]), where)
    queries = None if chats is not None else check_texts(list(split["query"]), where)
    if args.rule_reward and args.answer_column not in columns:
        fail("answer_column", f"split {args.dataset_eval_split!r} has no {args.answer_column!r} column (it has {columns})")
    if not args.rule_reward and args.reference_column not in columns and (
            chats is None or any(chat[-1]["role"] != "assistant" for chat in chats)):
        fail("reference_column", f"split {args.dataset_eval_split!r} has no {args.reference_column!r} column (it has "
                                 f"{columns}){'' if chats is None else ' and not every chat ends in a reply'}")
    if chats is not None and tokenizer.chat_template is None:
        fail("dataset_name", f"split {args.dataset_eval_split!r} holds `messages` but the tokenizer of "
                             f"{args.sft_model_path} has no chat template")
    if args.num_eval_prompts:
        split = split.select(range(min(args.num_eval_prompts, len(split))))
        chats, queries = chats and chats[: len(split)], queries and queries[: len(split)]
    texts = queries if chats is None else [
        tokenizer.apply_chat_template(chat[:-1] if chat[-1]["role"] == "assistant" else chat, tokenize=False,
                                      add_generation_prompt=True) for chat in chats]
    prompts = [q[-args.max_prompt_length:] for q in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    if args.rule_reward:
        return prompts, check_answers(args, list(split[args.answer_column]), where)
    reference_texts = (check_texts(list(split[args.reference_column]), where, args.reference_column, "reference_column")
                       if args.reference_column in columns else [chat[-1]["content"] for chat in chats])
    references = [r[: args.response_length - 1] + [stop_id] if stop_id not in r[: args.response_length] else
                  r[: r.index(stop_id) + 1] for r in
                  tokenizer(reference_texts, add_special_tokens=False)["input_ids"]]
    return prompts, references


def sample(args, policy, llm, prompts, tokenizer, stop_id, temperature, seed, device):
    """One response per prompt at `temperature`, truncated after the stop token, as a padded tensor."""
    pad = tokenizer.pad_token_id
    if llm is not None:
        responses = right_pad(vllm_generate(llm, prompts, 1, args.response_length, stop_id, temperature, seed)[0], pad,
                              device)
    else:
        torch.manual_seed(seed)
        chunks = [generate(policy, left_pad(prompts[i: i + args.per_device_eval_batch_size], pad, device), pad,
                           stop_id, args.response_length, temperature)
                  for i in range(0, len(prompts), args.per_device_eval_batch_size)]
        responses = right_pad([row for chunk in chunks for row in chunk.tolist()], pad, device)
    return truncate_response(responses, stop_id, pad)


@torch.no_grad()
def score(args, models, prompts, responses, tokenizers, device):
    """Per response, over batches: gold score, and the sums over response tokens of the policy's
    and the SFT model's log-probabilities at kl_temperature and of the SFT model's at temperature 1.
    `tokenizers` are the policy's and, when its vocabulary differs, the gold model's (else None)."""
    tokenizer, gold_tokenizer = tokenizers
    pad = tokenizer.pad_token_id
    out = {name: [] for name in ("gold", "policy_logprob", "sft_logprob", "sft_nll", "length")}
    for i in range(0, len(prompts), args.per_device_eval_batch_size):
        queries = left_pad(prompts[i: i + args.per_device_eval_batch_size], pad, device)
        chunk = responses[i: i + args.per_device_eval_batch_size]
        context_length, mask = queries.shape[1], chunk != pad
        query_responses = torch.cat([queries, chunk], 1)
        if models["gold"] is not None and gold_tokenizer is None:  # (no gold model with --rule-reward)
            out["gold"].append(reward_scores(models["gold"], query_responses, pad))
        elif models["gold"] is not None:  # another vocabulary (the paper's gold model): the text in its tokens
            texts = [tokenizer.decode(row[row != pad]) for row in query_responses]
            gold_ids = gold_tokenizer(texts, add_special_tokens=False)["input_ids"]
            out["gold"].append(reward_scores(models["gold"], left_pad(gold_ids, gold_tokenizer.pad_token_id, device),
                                             gold_tokenizer.pad_token_id))
        sft_logits = response_logits(models["sft"], query_responses, pad, context_length)
        if "policy" in models:
            policy_logits = response_logits(models["policy"], query_responses, pad, context_length)
            for name, logits in (("policy_logprob", policy_logits), ("sft_logprob", sft_logits)):
                out[name].append((response_logprobs(logits, chunk, args.kl_temperature) * mask).sum(1))
        out["sft_nll"].append(-(response_logprobs(sft_logits, chunk, 1.0) * mask).sum(1))
        out["length"].append(mask.sum(1))
    return {name: torch.cat(values).float() for name, values in out.items() if values}


def evaluate_checkpoint(args, models, llm, prompts, reference, tokenizers, stop_id, device):
    """The paper's metrics of one policy. `reference` holds the references' gold scores or, with --rule-reward,
    the answers: then the rule's mean score on the evaluated responses is the accuracy."""
    tokenizer = tokenizers[0]
    pad = tokenizer.pad_token_id
    responses = sample(args, models["policy"], llm, prompts, tokenizer, stop_id, args.temperature, args.seed, device)
    kl_samples = sample(args, models["policy"], llm, prompts, tokenizer, stop_id, args.kl_temperature,
                        args.seed + 1, device)
    evaluated = score(args, {"gold": models["gold"], "sft": models["sft"]}, prompts, responses, tokenizers, device)
    sampled = score(args, models, prompts, kl_samples, tokenizers, device)
    if args.rule_reward:
        texts = tokenizer.batch_decode(responses, skip_special_tokens=True)
        gold = torch.tensor([RULE_REWARDS[args.rule_reward](text, answer) for text, answer in zip(texts, reference)])
        metrics = {"accuracy": gold.mean().item()}
    else:
        gold = evaluated["gold"]
        metrics = {"win_rate": (gold > reference).float().mean().item(), "gold_score": gold.mean().item(),
                   "gold_margin": (gold - reference).mean().item()}
    perplexity = torch.exp(evaluated["sft_nll"] / evaluated["length"].clamp(min=1))
    metrics.update({
        "kl": (sampled["policy_logprob"] - sampled["sft_logprob"]).mean().item(),
        "perplexity": perplexity.mean().item(),
        "response_length": evaluated["length"].mean().item(),
    })
    samples = [[tokenizer.decode(prompts[i]), tokenizer.decode(responses[i][responses[i] != pad]), round(gold[i].item(), 3)]
               for i in range(min(4, len(prompts)))]
    return metrics, samples


def update_of(checkpoint):
    """The training update a checkpoint was saved at (None for a model that is not a checkpoint)."""
    state = os.path.join(checkpoint, "trainer_state.json")
    if not os.path.isfile(state):
        return None
    with open(state) as f:
        return json.load(f)["update"]


def main(args):
    """Evaluate every checkpoint (or the one model) and write the results: one vLLM engine or HF generation."""
    validate(args)
    checkpoints = find_checkpoints(args.checkpoints)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(args.seed)

    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)
    stop_id = stop_token_id(args, tokenizer)
    prompts, references = load_eval_data(args, tokenizer, stop_id)  # with --rule-reward: the answers
    gold_tokenizer = args.gold_reward_model_path and load_tokenizer(args.gold_reward_model_path, args.trust_remote_code)
    if gold_tokenizer and gold_tokenizer.get_vocab() == tokenizer.get_vocab():
        gold_tokenizer = None  # the gold model reads the policy's tokens as they are
    output = args.output or os.path.join(args.checkpoints if os.path.isdir(args.checkpoints) else ".",
                                         "evaluation.json")

    gold = load_model(args, args.gold_reward_model_path, reward=True)
    models = {"sft": load_model(args, args.sft_model_path).to(device), "gold": gold and gold.to(device)}
    pad = tokenizer.pad_token_id
    tokenizers = (tokenizer, gold_tokenizer)
    reference = references if args.rule_reward else score(args, models, prompts, right_pad(references, pad, device),
                                                           tokenizers, device)["gold"]

    if args.track:
        import wandb

        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, config=asdict(args),
                   name=f"evaluate__{os.path.basename(os.path.abspath(args.checkpoints))}__{int(time.time())}")
    llm, vllm_dir = None, tempfile.TemporaryDirectory(prefix="evaluate-")
    results = {}
    if args.rule_reward:
        print(f"{len(prompts)} prompts, {args.backend} generation; accuracy by the rule {args.rule_reward}", flush=True)
    else:
        print(f"{len(prompts)} prompts, {args.backend} generation; references: gold score "
              f"{reference.mean().item():.3f}" + ("" if gold_tokenizer is None else
                                                  " (the gold model scores the text in its own tokens)"), flush=True)
    columns = (["accuracy"] if args.rule_reward else ["win_rate", "gold_score"]) + ["kl", "perplexity", "response_length"]
    print(f"{'checkpoint':<40}{'update':>8}" + "".join(f"{column:>16}" for column in columns))
    try:
        for checkpoint in checkpoints:
            policy = load_policy(args, checkpoint).to(device)
            if args.backend == "vllm":
                path = checkpoint
                if untied_for_vllm(policy) or is_adapter(checkpoint):  # vLLM's copy of a tied model is untied (see
                    path = os.path.join(vllm_dir.name, "policy")  # write_for_vllm); an adapter's is the merged model
                    shutil.rmtree(path, ignore_errors=True)
                    write_for_vllm(policy, policy.state_dict(), path)
                    AutoTokenizer.from_pretrained(args.sft_model_path,  # a checkpoint's own is the SFT model's
                                                  trust_remote_code=args.trust_remote_code).save_pretrained(path)
                if llm is None:  # with room for the layer-wise reload of the next checkpoints
                    llm = start_vllm(args, path, sizes=parameter_bytes(policy))
                else:
                    load_into_vllm(llm, path)
            metrics, samples = evaluate_checkpoint(args, {**models, "policy": policy}, llm, prompts, reference,
                                                   tokenizers, stop_id, device)
            update = update_of(checkpoint)
            results[checkpoint] = {"update": update, **metrics}
            print(f"{os.path.basename(checkpoint.rstrip('/')):<40}{'' if update is None else update:>8}"
                  + "".join(f"{metrics[column]:>16.4f}" for column in columns), flush=True)
            if args.track:
                wandb.log({**{f"eval/{k}": v for k, v in metrics.items()}, "update": update or 0,
                           "eval/samples": wandb.Table(columns=["query", "response", "gold score"], data=samples)})
            del policy
    finally:
        if llm is not None:
            shut_down(llm)
        vllm_dir.cleanup()
    with open(output, "w") as f:
        json.dump({"args": asdict(args), "checkpoints": results,
                   **({} if args.rule_reward else {"reference_gold_score": reference.mean().item()})}, f, indent=1)
    print(f"wrote {output}")
    if args.track:
        wandb.finish()


# ===========================================================================================================
# This script's argument checks (checks.py holds those of every script), then the RLHF details it samples and scores
# with, the same in every script on purpose (tests/test_layout.py): evaluation samples and scores as training does.
# ===========================================================================================================

def validate(args):
    """Check the arguments before any model is loaded."""
    check_gpu_driver()
    if args.checkpoints is None:
        fail("checkpoints", "required: a run directory, a checkpoint or a model")
    check_model_path("checkpoints", args.checkpoints)
    for checkpoint in find_checkpoints(args.checkpoints):  # each loads as a policy (only a hub id is checked later)
        if is_adapter(checkpoint):
            check_adapter(checkpoint)
        else:
            check_model(SimpleNamespace(checkpoints=checkpoint, trust_remote_code=args.trust_remote_code), "checkpoints")
    check_dataset_path(args)
    check_model(args, "sft_model_path")
    if args.rule_reward is not None:
        if args.rule_reward not in RULE_REWARDS:
            fail("rule_reward", f"must be one of {sorted(RULE_REWARDS)}, got {args.rule_reward!r}")
        args.gold_reward_model_path = None  # the rule scores; no model is loaded
    elif args.gold_reward_model_path is None:
        fail("gold_reward_model_path", "required: the win rate is measured with a gold reward model")
    else:
        check_model(args, "gold_reward_model_path", reward=True)
    check_numbers(args)
    if args.output is not None and (os.path.isdir(args.output)
                                    or not os.path.isdir(os.path.dirname(os.path.abspath(args.output)))):
        fail("output", f"must be a file in an existing directory, got {args.output}")  # found before, not after, the work
    if args.temperature < 0:
        fail("temperature", f"must be 0 (greedy) or more, got {args.temperature}")
    if args.kl_temperature <= 0:
        fail("kl_temperature", f"must be positive, got {args.kl_temperature}")
    for name in ("response_length", "max_prompt_length", "per_device_eval_batch_size"):
        if getattr(args, name) < 1:
            fail(name, f"must be at least 1, got {getattr(args, name)}")
    if args.num_eval_prompts < 0:
        fail("num_eval_prompts", "must be 0 (all) or more")
    check_vllm_gpu(args)
    if not 1 <= args.vllm_cpu_cores <= len(os.sched_getaffinity(0)):
        fail("vllm_cpu_cores", f"must be between 1 and this machine's {len(os.sched_getaffinity(0))} cores, got "
                               f"{args.vllm_cpu_cores}")
    if args.vllm_gpu_memory_utilization is not None and not 0 < args.vllm_gpu_memory_utilization <= 1:
        fail("vllm_gpu_memory_utilization", f"must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
    if args.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        fail("bf16", "this GPU has no native bfloat16 (compute capability 8.0 or later: A100, H100, L4, RTX 30xx); "
                     "evaluate in float32 with --no-bf16")
    has_vllm = importlib.util.find_spec("vllm") is not None
    if args.backend == "vllm" and not has_vllm:
        fail("backend", "vllm is not installed")
    args.backend = "vllm" if args.backend == "auto" and has_vllm else "hf" if args.backend == "auto" else args.backend
    args.batch_size = args.per_device_eval_batch_size


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


def vllm_generate(llm, prompts, k, response_length, stop_token_id, temperature, seed, adapter=None):
    """k responses to each prompt (sample j of prompt i at j * len(prompts) + i) and the log-probability of each token
    under the weights that sampled it (the behaviour policy), at the sampling temperature. Request i gets seed + i, so a
    batch depends on the weights and seed only, not on what vLLM generated before (which keeps reruns and resumed runs
    exact). Temperature 0 is greedy. As in generate(), only the stop token ends a response (and is kept). With LoRA,
    `adapter` is the LoRARequest of the policy's adapter."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=prompt) for _ in range(k) for prompt in prompts]
    sampling = [SamplingParams(temperature=temperature, top_k=0, top_p=1.0, max_tokens=response_length,
                               ignore_eos=True, stop_token_ids=[stop_token_id], seed=seed + i, logprobs=0,
                               detokenize=False)  # token ids are all we use: no text decoded in this process
                for i in range(len(requests))]
    outputs = [output.outputs[0] for output in llm.generate(requests, sampling, lora_request=adapter, use_tqdm=False)]
    return ([list(out.token_ids) for out in outputs],
            [[step[token].logprob for token, step in zip(out.token_ids, out.logprobs)] for out in outputs])


if __name__ == "__main__":
    main(parse_arguments(Args))
