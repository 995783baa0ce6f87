"""Argument and input checks shared by every script: each failure is one line, `error: --<argument>: ...`, and exit
code 2, before any model loads (a script's own checks are its `validate`). Nothing here changes what is learned."""

import json
import math
import os
import sys
from dataclasses import asdict

import torch
import tyro
from tqdm import tqdm
from transformers import AutoConfig


def fail(argument, message):
    """Bad input: one line on stderr naming the argument, exit code 2 (a line of its own also where the run's
    progress bar is on the screen: a run may stop this way, as dynamic sampling does when it runs out of rounds)."""
    tqdm.write(f"error: --{argument.replace('_', '-')}: {message}", file=sys.stderr)
    sys.exit(2)


def parse_arguments(args_class):
    """The command line as an `args_class` (tyro.cli). What tyro rejects (a word where a number goes, a missing value,
    an unknown argument) ends as every other bad input does: one line naming the argument, exit code 2, not tyro's
    box. (tyro._errors is tyro's experimental hook, hence tyro's exact pin.)"""
    from tyro import _errors

    def one_line(event):
        argument = getattr(event, "argument", None)
        name = argument and "/".join(argument.lowered.name_or_flags)
        if isinstance(event, _errors.InstantiationFailure) and name:
            message = event.message
        elif isinstance(event, _errors.BadValue):
            message = "needs a value" if event.offending_value is None else f"takes no {event.offending_value!r}"
        elif isinstance(event, _errors.InvalidChoice):
            message = f"must be one of {', '.join(event.choices)}, got {event.value!r}"
        elif isinstance(event, _errors.UnrecognizedArgs):
            name, message = event.tokens[0], "is not an argument of this script, or a value of none (see --help)"
        else:
            return  # tyro's own message
        print(f"error: {name}: {message}", file=sys.stderr)
        sys.exit(2)

    with _errors.on_parse_error(one_line):
        return tyro.cli(args_class)


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


def check_run(args, rules):
    """The checks of every algorithm script after its own: --missing-eos-mode, --bf16 on this GPU, the files, every
    number, the dataset's path, the policy, the reward models or one of the script's `rules`, and the model's
    positions."""
    if args.bf16 and torch.cuda.is_available() and not torch.cuda.is_bf16_supported(including_emulation=False):
        fail("bf16", "this GPU has no native bfloat16 (compute capability 8.0 or later: A100, H100, L4, RTX 30xx); "
                     "train in float32 with --no-bf16")
    check_files(args)
    check_numbers(args)
    check_dataset_path(args)
    check_model(args, "sft_model_path")
    check_rewards(args, rules)
    config = AutoConfig.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    positions = getattr(config, "max_position_embeddings", None)
    if positions is not None and args.max_prompt_length + args.response_length > positions:
        fail("response_length", f"max_prompt_length + response_length = {args.max_prompt_length + args.response_length}"
                                f" exceeds the model's {positions} positions")


def check_model_path(argument, path):
    looks_like_hub_id = path.count("/") == 1 and not path.startswith((".", "/", "~"))
    if os.path.isfile(path):
        fail(argument, f"{path} is a file, not a directory")
    if not os.path.isdir(path) and not looks_like_hub_id:
        fail(argument, f"no such directory: {path}{asset_hint(path)}")


def asset_hint(path):
    """How to build a missing directory under assets/<name>/ (the SmolLM2 model is built, not shipped:
    assets/make_smollm2.py), or nothing."""
    root = os.path.dirname(os.path.abspath(__file__))
    parts = os.path.relpath(os.path.abspath(path), root).split(os.sep)
    builder = os.path.join("assets", f"make_{parts[1]}.py") if len(parts) > 1 and parts[0] == "assets" else ""
    return f" (build it with `python {builder}`)" if builder and os.path.isfile(os.path.join(root, builder)) else ""


def check_dataset_path(args):
    """--dataset-name: a directory that holds files, or a hub id (checked when it loads)."""
    path = args.dataset_name
    if os.path.isfile(path):
        fail("dataset_name", f"{path} is a file, not a directory of data files")
    if not os.path.isdir(path) and path.count("/") != 1:
        fail("dataset_name", f"no such directory: {path}{asset_hint(path)}")
    if os.path.isdir(path) and not os.listdir(path):
        fail("dataset_name", f"{path} is an empty directory")


def check_hub_model(argument, repo_id):
    """A model argument that is no local directory names a hub repository: in the hub's cache, or reachable now (not
    after transformers' retries, in its traceback)."""
    from huggingface_hub import constants, errors, model_info, try_to_load_from_cache

    if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
        return  # loads from the cache, offline too
    offline = "set HF_HUB_OFFLINE=1 to load a model from the hub's cache, or pass a local directory"
    if constants.HF_HUB_OFFLINE:
        fail(argument, f"{repo_id} is not a local directory, nor in the hub's cache, and HF_HUB_OFFLINE is set: pass "
                       "a local directory")
    try:
        model_info(repo_id, timeout=10)
    except errors.RepositoryNotFoundError:  # a gated repository too
        fail(argument, f"{repo_id} is not a local directory, and the Hugging Face hub has no model of that name that "
                       "this machine may read (a typo, or a private repository: log in with `hf auth login`)")
    except Exception as error:  # no network, a proxy, a timeout
        cause = (str(error).strip().splitlines() or [type(error).__name__])[0]
        fail(argument, f"{repo_id} is not a local directory, and the Hugging Face hub cannot be reached ({cause}): "
                       f"{offline}")


def check_model(args, argument, reward=False):
    """A model argument, before anything loads: a directory with a readable config and a tokenizer, or a hub id in the
    cache or on a reachable hub (its files are checked when it loads); a reward model is a sequence classifier (any
    other gets a random score head), a policy is not."""
    path = getattr(args, argument)
    check_model_path(argument, path)
    if not os.path.isdir(path):
        check_hub_model(argument, path)
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


def check_rewards(args, rules):
    """A reward model (and an optional gold one), or with --rule-reward one of the script's `rules` and no reward
    models."""
    if args.rule_reward is not None:
        if args.rule_reward not in rules:
            fail("rule_reward", f"must be one of {sorted(rules)}, got {args.rule_reward!r}")
        args.reward_model_path = args.gold_reward_model_path = None  # the rule scores; no model is loaded
        return
    if args.reward_model_path is None:
        fail("reward_model_path", "required unless --rule-reward names a rule")
    check_model(args, "reward_model_path", reward=True)
    if args.gold_reward_model_path is not None:
        check_model(args, "gold_reward_model_path", reward=True)


def check_bounds(args, positive=(), at_least_0=(), lower_clips=()):
    """Number arguments within their bounds: the batch sizes, lengths and counts of every script at least 1, its
    temperature and learning rate positive, its evaluation and save intervals 0 or more, and the script's own; a
    ratio's lower clip range (the ratio is clipped below at 1 - it) in (0, 1)."""
    at_least_1 = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_mini_batches", "num_ppo_epochs",
                  "response_length", "max_prompt_length", "total_episodes", "num_eval_prompts")
    for names, low, strict in ((at_least_1, 1, False), (positive + lower_clips + ("temperature", "learning_rate"), 0, True),
                               (at_least_0 + ("eval_every", "save_every"), 0, False)):
        for name in names:
            value = getattr(args, name)
            if value < low or (strict and value == low):
                fail(name, f"must be {'positive' if strict else f'at least {low}'}, got {value}")
    for name in lower_clips:
        if getattr(args, name) >= 1:
            fail(name, f"must be below 1: the ratio is clipped below at 1 - {name.replace('_', '-')}, which would be "
                       f"{1 - getattr(args, name):g}, got {getattr(args, name)}")


def check_batch_sizes(args):
    """The sizes a run derives from its arguments, set in `args`: responses a rank trains on per update (per-device
    batch x accumulation x mini-batches), of every rank, and the updates --total-episodes makes (at least one)."""
    args.local_batch_size = args.per_device_train_batch_size * args.gradient_accumulation_steps * args.num_mini_batches
    args.batch_size = args.local_batch_size * args.world_size
    args.num_updates = args.total_episodes // args.batch_size
    if args.num_updates < 1:
        fail("total_episodes", f"must be at least one batch of {args.batch_size} responses")


def check_lora(args):
    """--lora-rank 0 (full fine-tuning) or a LoRA adapter: a positive alpha, no dropout, target modules the
    policy has (its module names read from an empty, meta-device copy: nothing loads)."""
    if args.lora_rank < 0:
        fail("lora_rank", f"must be 0 (full fine-tuning) or positive, got {args.lora_rank}")
    if args.lora_alpha <= 0:
        fail("lora_alpha", f"must be positive (the adapter's output is scaled by lora_alpha / lora_rank), got {args.lora_alpha}")
    if args.lora_dropout != 0:  # the learner's passes would drop inputs that sampling (HF or vLLM) never drops
        fail("lora_dropout", f"must be 0, got {args.lora_dropout}: responses are sampled without dropout, so with it "
                             "a policy's ratio to itself is not 1 (at one optimizer step a batch the clip would cut "
                             "and the importance weights pick up dropout's noise)")
    if args.lora_rank == 0 or args.lora_target_modules == "all-linear":
        return
    from transformers import AutoModelForCausalLM

    config = AutoConfig.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=args.trust_remote_code)
    linear = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                     if isinstance(module, torch.nn.Linear)})
    missing = [name for name in args.lora_target_modules.split(",") if name not in linear]
    if missing:
        fail("lora_target_modules", f"the policy has no linear layer {missing[0]!r}: it has {', '.join(linear)} "
                                    "(or use all-linear)")


def check_numbers(args):
    """Every number argument is finite and the seed one that every generator takes."""
    for name, value in asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(name, f"must be a finite number, got {value}")
    if not 0 <= args.seed < 2**31:  # vLLM's per-batch seeds are seed * 2**32 + an offset: under 2**64
        fail("seed", f"must be in [0, 2**31), got {args.seed}")


def check_files(args):
    """--deepspeed-config is a JSON file with a ZeRO stage, offload devices DeepSpeed knows, no fp16 and a number for
    gradient_clipping (what the scripts read of it; distributed.check_deepspeed_config lets DeepSpeed check the rest
    once the process group is up); --output-dir is not a file."""
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
    zero = config["zero_optimization"]
    if zero["stage"] not in (0, 1, 2, 3) or isinstance(zero["stage"], bool):
        fail("deepspeed_config", f"{args.deepspeed_config}: zero_optimization.stage must be 0, 1, 2 or 3, got "
                                 f"{zero['stage']!r}")
    for part in ("offload_optimizer", "offload_param"):
        offload = zero.get(part, {})
        if not isinstance(offload, dict) or offload.get("device", "none") not in ("none", "cpu", "nvme"):
            fail("deepspeed_config", f"{args.deepspeed_config}: zero_optimization.{part} must be an object whose "
                                     f"device is none, cpu or nvme, got {offload!r}")
    if isinstance(config.get("fp16"), dict) and config["fp16"].get("enabled"):
        fail("deepspeed_config", f"{args.deepspeed_config}: fp16 is not supported (no loss scaling here): train in "
                                 "bfloat16 (--bf16) or float32")
    # What the script fills in from its arguments: a config that says otherwise contradicts them (DeepSpeed refuses
    # such a config; here it would be overwritten without a word).
    from_arguments = {"train_micro_batch_size_per_gpu": (args.per_device_train_batch_size, "--per-device-train-batch-size"),
                      "gradient_accumulation_steps": (args.gradient_accumulation_steps, "--gradient-accumulation-steps"),
                      "train_batch_size": (args.per_device_train_batch_size * args.gradient_accumulation_steps *
                                           args.world_size, "--per-device-train-batch-size x "
                                           "--gradient-accumulation-steps x processes")}
    for key, (value, source) in from_arguments.items():
        if config.get(key, "auto") not in ("auto", value):
            fail("deepspeed_config", f"{args.deepspeed_config}: {key} is {config[key]!r}, but this run's arguments make it {value} "
                                     f"({source}): "
                                     f"leave it out of the config (the script fills it in) or make them agree")
    bf16 = config.get("bf16", {}).get("enabled", "auto") if isinstance(config.get("bf16"), dict) else "auto"
    if bf16 != "auto" and bool(bf16) != args.bf16:
        fail("deepspeed_config", f"{args.deepspeed_config}: bf16.enabled is {bf16!r}, but this run has "
                                 f"{'--bf16' if args.bf16 else '--no-bf16'}: leave it out of the config or make them agree")
    clipping = config.get("gradient_clipping", 0.0)
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or not 0 <= clipping < math.inf:
        fail("deepspeed_config", f"{args.deepspeed_config}: gradient_clipping must be a number, 0 or more, got "
                                 f"{clipping!r}")
    if os.path.isfile(args.output_dir):
        fail("output_dir", f"{args.output_dir} is a file, not a directory")
