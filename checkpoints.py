"""Checkpoints and resume: checkpoint-N/ holds the policy as save_pretrained (what transformers, vLLM and evaluate.py
load) and training_state/ (DeepSpeed's state of each trained model, every rank's random state), written whole or not
at all; --resume checks that the checkpoint was written by this script with the arguments a resumed run must keep, and
restores it exactly. Nothing here changes what is learned."""

import json
import os
import shutil
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from distributed import gathered_state_dict  # (first: it sets DS_ACCELERATOR before deepspeed is imported)
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
from safetensors import SafetensorError
from tqdm import tqdm
from transformers import AutoTokenizer

import timeline
from checks import fail

SCRIPT = os.path.basename(sys.argv[0])  # the script that runs (a copy too: my_rloo.py), named in its checkpoints


# The arguments a resumed run may change, and why. Every other argument of the script's Args must be the checkpoint's:
# it decides which prompts an update takes, or how its batch is made, sampled, scored or trained on from the restored
# state (tests/test_plumbing.py holds every script's Args to this).
RESUME_MAY_CHANGE = {
    "exp_name": "it names the run", "track": "logging", "wandb_project_name": "logging", "wandb_entity": "logging",
    "output_dir": "where new runs go", "resume": "the checkpoint itself", "local_rank": "the launcher sets it",
    "eval_every": "evaluation only", "num_eval_prompts": "evaluation only", "dataset_eval_split": "evaluation only",
    "gold_reward_model_path": "evaluation only", "save_every": "when checkpoints are written",
    "sft_model_path": "a path: the same model may lie elsewhere on resume (the policy's weights are the checkpoint's)",
    "reward_model_path": "a path: the same model may lie elsewhere on resume",
    "deepspeed_config": "a path; DeepSpeed itself refuses the state of another ZeRO stage",
    "trust_remote_code": "a permission", "gradient_checkpointing": "memory, not values",
    "generation_timeout": "how long to wait", "check_weights_every": "a check, not what is learned",
    "vllm_gpu": "placement", "vllm_gpu_memory_utilization": "memory", "vllm_cpu_cores": "placement",
    "vllm_enforce_eager": "vLLM's speed (its compiled kernels may round differently)",
    "weight_sync": "how the weights reach vLLM, not which",
}


def check_resume(args):
    """--resume names a run or checkpoint directory of this script, written with this run's arguments but those of
    RESUME_MAY_CHANGE (logging, evaluation, placement): so that the resumed run repeats the stopped one. `--bf16` is
    among them (DeepSpeed names its state files by it), and the number of processes."""
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
    if script not in (None, SCRIPT):
        fail("resume", f"{args.resume} holds a checkpoint of {script}, not of {SCRIPT}")
    for name in sorted(saved.keys() - RESUME_MAY_CHANGE.keys()):
        if hasattr(args, name) and getattr(args, name) != saved[name]:
            what = "processes" if name == "world_size" else f"as --{name.replace('_', '-')}"
            fail("resume", f"{path} was written with {saved[name]} {what}, this run has {getattr(args, name)}: "
                           "a resumed run must keep it")


def latest_checkpoint(path):
    """`path` if it is a checkpoint, else the checkpoint of `path` with the highest update."""
    if os.path.isfile(os.path.join(path, "trainer_state.json")):
        return path
    updates = [int(d.split("-")[1]) for d in os.listdir(path) if d.startswith("checkpoint-") and d[len("checkpoint-"):].isdigit()]
    if not updates:
        fail("resume", f"no checkpoint in {path}")
    return os.path.join(path, f"checkpoint-{max(updates)}")


def resume_hint(run_dir):
    """What a run that stops on a fault says about going on: the newest checkpoint to --resume from, if any."""
    updates = [int(d[len("checkpoint-"):]) for d in os.listdir(run_dir) if d.startswith("checkpoint-")
               and d[len("checkpoint-"):].isdigit()] if os.path.isdir(run_dir) else []
    if not updates:
        return "no checkpoint was written yet (--save-every saves more often)"
    return f"resume with --resume {os.path.join(run_dir, f'checkpoint-{max(updates)}')}"


def partition_elements(numel, partition_size, rank):
    """How many of a ZeRO-3 partition's elements are its parameter's (of `numel`): the last ranks' partitions end in
    padding that DeepSpeed allocates and never writes (torch.empty), which may read as NaN."""
    return max(0, min(partition_size, numel - partition_size * rank))


@torch.no_grad()
def stop_if_diverged(engines, probe, update, run_dir, learning_rate):
    """Stop the run in one line (exit code 1) when an update has left a trained model ({name: engine}; the policy
    first) with weights that are not finite, or the policy with non-finite logits on `probe` (a prompt's tokens: huge
    but finite weights overflow there), before it is sampled from, handed to vLLM or saved: no checkpoint holds such
    weights. Every rank calls this (under ZeRO-3 each checks its share, not its padding, and the probe's forward
    gathers)."""
    for name, engine in engines.items():
        local = [p.ds_tensor.narrow(0, 0, partition_elements(p.ds_numel, p.ds_tensor.numel(),
                                                             dist.get_rank(p.ds_process_group)))
                 if hasattr(p, "ds_tensor") else p for p in engine.module.parameters()]
        finite = torch.stack([n.float() for n in torch._foreach_norm(local)]).isfinite().all()
        if name == "policy":
            logits = engine(input_ids=torch.tensor([probe], device=engine.device), use_cache=False).logits
            finite = finite & logits.isfinite().all()
        finite = finite.float().reshape(1)
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():
            if dist.get_rank() == 0:  # a line of its own, under the progress bar
                tqdm.write(f"error: the {name} diverged at update {update}: its weights or outputs are inf or NaN; "
                           f"lower --learning-rate (now {learning_rate:g}) or look for a non-finite reward; "
                           f"{resume_hint(run_dir)}", file=sys.stderr)
            sys.exit(1)


def save_checkpoint(args, run_dir, update, episode, engines, extra_files=None, rank_state=None):
    """Write <run_dir>/checkpoint-<update>: every trained model as save_pretrained (the policy at the top with the SFT
    model's own tokenizer, others such as PPO's value model in a subdirectory of their name), the training state in
    training_state/ (each engine's DeepSpeed state, every rank's RNG state and `rank_state`, plain Python values that
    load_rank_state() returns) and rank 0's `extra_files` ({name: JSON}).
    Written to a temporary directory renamed at the end: an interruption leaves no half-written checkpoint, and a
    failed write (a full disk) removes it and ends the run with one line."""
    final = os.path.join(run_dir, f"checkpoint-{update}")
    tmp, start = final + ".tmp", time.time()
    try:
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        dist.barrier()
        for name, engine in engines.items():
            # With LoRA the frozen base weights are not saved (the run reloads them from --sft-model-path).
            engine.save_checkpoint(os.path.join(tmp, "training_state"), tag=name, save_latest=False,
                                   exclude_frozen_parameters=True)
            state_dict = gathered_state_dict(engine)
            if dist.get_rank() == 0:
                engine.module.save_pretrained(tmp if name == "policy" else os.path.join(tmp, name), state_dict=state_dict)
        torch.save({"torch": torch.get_rng_state(), "accelerator": get_accelerator().get_rng_state(),
                    "device": get_accelerator().device_name()},
                   os.path.join(tmp, "training_state", f"rng_rank{dist.get_rank()}.pt"))
        if rank_state is not None:
            torch.save(rank_state, os.path.join(tmp, "training_state", f"state_rank{dist.get_rank()}.pt"))
        if dist.get_rank() == 0:
            AutoTokenizer.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code).save_pretrained(tmp)
            with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
                json.dump({"script": SCRIPT, "update": update, "episode": episode, "args": asdict(args)},
                          f, indent=1)
            for name, content in (extra_files or {}).items():
                with open(os.path.join(tmp, name), "w") as f:
                    json.dump(content, f)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
        dist.barrier()
        timeline.record("checkpoint", start, time.time(), update=update)
    except (OSError, RuntimeError, SafetensorError) as error:  # a full disk: torch.save raises RuntimeError,
        # save_pretrained safetensors' own error, the rest OSError
        free = shutil.disk_usage(run_dir).free / 2**20
        shutil.rmtree(tmp, ignore_errors=True)
        sys.exit(f"error: could not write {final} ({str(error).splitlines()[0]}; {free:.1f} MiB free on its disk): "
                 "the partial checkpoint is removed, earlier checkpoints are intact")
    except BaseException:  # a signal's exit (SIGTERM, Ctrl-C) while writing: no partial checkpoint stays either
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_checkpoint(checkpoint, engines):
    """Restore the training state written by save_checkpoint into rank 0's `checkpoint` (where nodes share a directory,
    another node's listing of it may lag and name an older one); returns (update, episode)."""
    chosen = [checkpoint]
    dist.broadcast_object_list(chosen, src=0)
    checkpoint = chosen[0]
    for name, engine in engines.items():
        engine.checkpoint_engine = SafeCheckpointEngine()
        frozen = any(not p.requires_grad for p in engine.module.parameters())  # LoRA's base: not in the checkpoint
        engine.load_checkpoint(os.path.join(checkpoint, "training_state"), tag=name, load_module_strict=not frozen)
    rng = torch.load(os.path.join(checkpoint, "training_state", f"rng_rank{dist.get_rank()}.pt"), weights_only=True)
    torch.set_rng_state(rng["torch"])
    if rng.get("device", get_accelerator().device_name()) == get_accelerator().device_name():  # a GPU's fits no CPU
        get_accelerator().set_rng_state(rng["accelerator"])
    with open(os.path.join(checkpoint, "trainer_state.json")) as f:
        state = json.load(f)
    return state["update"], state["episode"]


def resumed_update(args):
    """The update a run goes on from: its --resume checkpoint's (rank 0's latest, as load_checkpoint), or 0."""
    if not args.resume:
        return 0
    chosen = [latest_checkpoint(args.resume)]
    dist.broadcast_object_list(chosen, src=0)
    with open(os.path.join(chosen[0], "trainer_state.json")) as f:
        return json.load(f)["update"]


def load_rank_state(checkpoint):
    """This rank's `rank_state` of save_checkpoint in rank 0's `checkpoint` (as load_checkpoint), loaded with
    weights_only: plain values, no code."""
    chosen = [checkpoint]
    dist.broadcast_object_list(chosen, src=0)
    return torch.load(os.path.join(chosen[0], "training_state", f"state_rank{dist.get_rank()}.pt"), weights_only=True)


class SafeCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed's checkpoint engine, but loading with weights_only=True so that a checkpoint cannot run code."""

    def load(self, path, map_location=None):
        from deepspeed.runtime.fp16.loss_scaler import LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address

        with torch.serialization.safe_globals([LossScaler, ZeroStageEnum, fragment_address]):
            return torch.load(path, map_location=map_location, weights_only=True)
