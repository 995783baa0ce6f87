"""The process group, each rank's device and vLLM's GPU (its placement beside the training ranks), DeepSpeed's
configuration and ZeRO-3's gathering of parameters (for generation and for saving); the averaging of metrics over ranks. What here changes what is learned: under LoRA the
reference is the policy with its adapter switched off (reference_model)."""

import contextlib
import functools
import json
import os
import socket

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # must be set before deepspeed is imported

import deepspeed
import pydantic
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.config import DeepSpeedConfig
from deepspeed.runtime.zero.stage3 import unwrap_model_for_generation

from checks import fail


def set_up_distributed(args):
    """Join the process group and take this rank's device; returns (rank, device)."""
    init_distributed()
    rank = dist.get_rank()
    # The local rank: deepspeed's launcher passes --local_rank and sets LOCAL_RANK; torchrun sets LOCAL_RANK only.
    device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", args.local_rank))))
    if torch.cuda.is_available():
        torch.cuda.set_device(device)
    torch.manual_seed(args.seed + rank)  # each rank samples different responses
    check_deepspeed_config(args)
    return rank, device


def check_deepspeed_config(args):
    """--deepspeed-config as DeepSpeed reads it (its own check of every field, with this run's batch sizes and
    processes), before any model loads: one line naming the field rather than a traceback after the loading."""
    try:
        DeepSpeedConfig(ds_config(args, train=True))
    except pydantic.ValidationError as error:
        first = error.errors()[0]
        where = ".".join(map(str, first["loc"])) + (" of zero_optimization" if "Zero" in error.title else "")
        fail("deepspeed_config", f"{args.deepspeed_config}: {where}: {first['msg']}, got {first['input']!r}")
    except (AssertionError, ValueError, TypeError, KeyError) as error:
        fail("deepspeed_config", f"{args.deepspeed_config}: {str(error).splitlines()[0]}")


def init_distributed():
    """Join the process group; a plain `python` launch is a group of one."""
    if "RANK" not in os.environ:  # a free port, so several single-process runs can share a machine
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    deepspeed.init_distributed(dist_backend=process_group_backend(torch.cuda.is_available()))


def process_group_backend(cuda):
    """torch.distributed's backend for each device type. NCCL reduces only CUDA tensors ("No backend type
    associated with device type cpu"), so on GPUs gloo serves the collectives on CPU objects beside it."""
    return "cpu:gloo,cuda:nccl" if cuda else "gloo"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ds_config(args, train):
    with open(args.deepspeed_config) as f:
        config = json.load(f)
    accumulation = args.gradient_accumulation_steps if train else 1
    config.update(train_micro_batch_size_per_gpu=args.per_device_train_batch_size,
                  gradient_accumulation_steps=accumulation,
                  train_batch_size=args.per_device_train_batch_size * accumulation * args.world_size,
                  bf16={"enabled": args.bf16})
    if not train:  # frozen models: partitioned under ZeRO-3 (offloaded if its parameters are), else replicated
        zero = config["zero_optimization"]
        config = {k: v for k, v in config.items() if k not in ("zero_optimization", "gradient_clipping")}
        config["zero_optimization"] = {"stage": 0}
        if zero["stage"] == 3:
            config["zero_optimization"] = {k: v for k, v in zero.items() if k != "offload_optimizer"}
    return config


def adam_class(config):
    """AdamW with its step fused into one kernel per group (unfused, a CPU's AdamW loops over the tensors doing an
    element-wise operation at a time: several passes over the weights a step), or DeepSpeed's CPU Adam where the
    config offloads the optimizer to the CPU."""
    offload = config["zero_optimization"].get("offload_optimizer", {}).get("device", "none") != "none"
    return deepspeed.ops.adam.DeepSpeedCPUAdam if offload else functools.partial(torch.optim.AdamW, fused=True)


def frozen_engine(args, model):
    """A DeepSpeed engine that only runs `model` forward (partitioned under ZeRO-3); None for None."""
    if model is None:
        return None
    return deepspeed.initialize(model=model.eval(), config=ds_config(args, train=False))[0]


@contextlib.contextmanager
def reference_model(policy, ref_policy):
    """The frozen reference to run forward: `ref_policy`, or with LoRA (no ref_policy) the policy itself with its
    adapter switched off (peft's disable_adapter): the base weights, no second copy of them."""
    if ref_policy is not None:
        yield ref_policy
        return
    with policy.module.disable_adapter():
        yield policy


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


def gathered_state_dict(engine):
    """The engine's weights for save_pretrained, in rank 0's CPU memory (None elsewhere). Under ZeRO-3 every rank takes
    part in gathering them one module at a time, so no device ever holds the whole model; with LoRA only the trained
    parameters (the adapter: all that peft's save_pretrained writes), never the frozen base."""
    module, rank = engine.module, dist.get_rank()
    if engine.zero_optimization_stage() != 3:
        return module.state_dict() if rank == 0 else None
    state, copies = {}, {}
    frozen_base = any(not p.requires_grad for p in module.parameters())
    for prefix, submodule in module.named_modules():
        own = [(name, p) for name, p in submodule.named_parameters(prefix=prefix, recurse=False)
               if p.requires_grad or not frozen_base]
        with deepspeed.zero.GatheredParameters([p for _, p in own]):
            if rank == 0:
                for name, param in own:  # tied weights (one parameter under two names) are copied once
                    state[name] = copies.setdefault(id(param), param.detach().cpu().clone())
    if rank != 0:
        return None
    persistent = module.state_dict().keys()  # keys only: under ZeRO-3 its parameters are empty shards
    state.update({name: buffer.cpu() for name, buffer in module.named_buffers() if name in persistent})
    return state


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
        if vllm_gpu >= num_node_gpus:
            fail("vllm_gpu", f"this node has {num_node_gpus} GPU(s), indices 0 to {num_node_gpus - 1}, got {vllm_gpu}")
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


def vllm_gpu(args):
    """vllm_gpu_placement() on this node: NVML counts its GPUs, also those the deepspeed launcher hid from this process."""
    import pynvml

    pynvml.nvmlInit()
    return vllm_gpu_placement(os.environ, pynvml.nvmlDeviceGetCount(), args.vllm_gpu)
