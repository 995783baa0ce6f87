"""The machinery every script imports (checks, data, distributed, checkpoints, vllm_engine, weight_handoff,
generator) and the RLHF details every script holds (kept identical by test_layout.py), tested once here: truncation, log-probabilities, the missing-EOS penalty, prompt batches, the decoding loop against HF
`generate`, and what a GPU run depends on, through the same logic on the CPU: process-group backends, vLLM's
GPU and memory share, the weight hand-off's memory, bf16 and the DeepSpeed configs. (The prefix-cache reset
is in test_online_dpo_vllm.py, the gold model's other tokenizer in test_evaluate.py; what no CPU can check
is in benchmark/gpu_smoke.sh.)"""

import ast
import dataclasses
import glob
import importlib
import importlib.util
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
import types

import deepspeed
import pytest
import torch
import torch.distributed as dist
from conftest import ALGORITHMS, ROOT, SCRIPTS, SHIPPED, TINY, run_patched
from deepspeed.runtime.config import DeepSpeedConfig
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import checkpoints
import checks
import data
import distributed
import generator
import online_dpo_vllm
import rloo
import vllm_engine
import weight_handoff

STOP, PAD = 0, 1


def trained_engine(args, model):
    """A DeepSpeed engine that trains `model`, set up as the scripts' main() sets up the policy's."""
    config = distributed.ds_config(args, train=True)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = distributed.adam_class(config)(trained, lr=args.learning_rate, eps=1e-5, weight_decay=0.0)
    return deepspeed.initialize(model=model, optimizer=optimizer, config=config)[0]


def test_truncate_response_pads_after_the_first_stop_token_and_from_the_first_pad():
    responses = torch.tensor([
        [5, 3, STOP, 7, STOP],  # text after the stop token becomes padding; the stop token stays
        [5, 6, 7, 8, 9],  # no stop token: unchanged
        [STOP, 4, 4, 4, 4],  # an empty response
        [5, PAD, 6, 7, 8],  # a sampled pad token ends the response
    ])
    assert rloo.truncate_response(responses, STOP, PAD).tolist() == [
        [5, 3, STOP, PAD, PAD],
        [5, 6, 7, 8, 9],
        [STOP, PAD, PAD, PAD, PAD],
        [5, PAD, PAD, PAD, PAD],
    ]


def test_logprobs_use_logits_divided_by_the_temperature():
    # A response of 2 tokens, vocabulary of 3: the logits that predict them (response_logits).
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 4.0, 2.0]]])
    logprobs = rloo.response_logprobs(logits, torch.tensor([[0, 2]]), temperature=2.0)
    # Scaled logits [1, 0, 0] and [0, 2, 1]: log p = x_i - log(sum exp x).
    expected = [1 - math.log(math.e + 2), 1 - math.log(1 + math.e ** 2 + math.e)]
    assert torch.allclose(logprobs, torch.tensor([expected]), atol=1e-6)


def full_response_logits(model, query_responses, pad, context_length):
    """The computation response_logits replaces: the head on every position, then the response's positions kept."""
    return rloo.forward(model, query_responses, pad).logits[:, context_length - 1: -1]


def test_the_head_runs_on_the_response_alone_and_gives_the_full_computations_values():
    """response_logits runs the language-model head on the response's positions and the one before (5 of 21 here),
    not the prompt's; its logits, the sampled tokens' log-probabilities (a gather minus a logsumexp) and the entropy
    equal those of the head on every position and a full log-softmax."""
    model, queries, pad, stop = tiny_policy()
    torch.manual_seed(0)
    responses = rloo.truncate_response(rloo.generate(model, queries, pad, stop, 8, temperature=0.7), stop, pad)
    query_responses, context_length = torch.cat([queries, responses], 1), queries.shape[1]
    head_positions = []
    model.get_output_embeddings().register_forward_hook(lambda module, inputs, out: head_positions.append(out.shape[1]))
    with torch.no_grad():
        ours = rloo.response_logits(model, query_responses, pad, context_length)
        full = full_response_logits(model, query_responses, pad, context_length)
    assert head_positions == [responses.shape[1] + 1, query_responses.shape[1]] == [5, 21]  # (all stopped by 4)
    assert ours.shape == full.shape == (8, 4, model.config.vocab_size) and (ours - full).abs().max() < 1e-5
    expected = torch.log_softmax(full / 0.7, -1).gather(-1, responses.clamp(max=full.shape[-1] - 1).unsqueeze(-1))
    assert (rloo.response_logprobs(ours, responses, 0.7) - expected.squeeze(-1)).abs().max() < 1e-5
    probs = torch.softmax(full / 0.7, -1)
    assert (rloo.entropy_from_logits(ours / 0.7) + (probs * probs.log()).sum(-1)).abs().max() < 1e-5


def test_every_pass_whose_logits_a_shipped_script_reads_names_the_positions_it_keeps():
    """A model's `.logits` are read in the shipped scripts only from a call that passes logits_to_keep (response_logits;
    the decoding step's 1): no pass runs the language-model head on a prompt whose logits nothing reads."""
    for script in SHIPPED:
        with open(os.path.join(ROOT, script)) as f:
            tree = ast.parse(f.read())
        full = [ast.unparse(node) for node in ast.walk(tree) if isinstance(node, ast.Attribute) and node.attr == "logits"
                and isinstance(node.value, ast.Call) and "logits_to_keep" not in [k.arg for k in node.value.keywords]]
        assert not full, f"{script}: {full}"


HEAD_SPY = """
import json, runpy, sys, torch
passes, length = [], [0]
def spy(module, inputs, output):  # each pass of the head: (sequences, their length, the positions the head computed)
    if isinstance(module, torch.nn.Embedding):
        length[0] = inputs[0].shape[1]
    elif isinstance(module, torch.nn.Linear) and module.out_features == 638:  # the tiny task's vocabulary: the head
        passes.append(output.shape[:2] + (length[0],))
torch.nn.modules.module.register_module_forward_hook(spy)
sys.argv = ["rloo.py"] + sys.argv[1:]
try:
    runpy.run_path("rloo.py", run_name="__main__")
finally:
    print("PASSES " + json.dumps(passes), flush=True)
"""


def test_a_runs_scoring_and_training_passes_run_the_head_on_the_response_alone(tmp_path):
    """rloo.py with a LoRA adapter (peft and a DeepSpeed engine between the script and the model), two updates: every
    pass of the head over a whole sequence (the policy's and the reference's, scoring and training) computes the
    response's positions and the one before, never the prompt's (about 15 s)."""
    result, errors = run_patched(HEAD_SPY, "--lora-rank", "4", "--learning-rate", "1e-3", "--total-episodes", "128",
                                 "--num-ppo-epochs", "2", "--eval-every", "0", "--output-dir", str(tmp_path))
    assert result.returncode == 0 and not errors, result.stderr[-3000:]
    passes = json.loads(next(line for line in result.stdout.splitlines() if line.startswith("PASSES "))[7:])
    # (not decoding steps, 1 position, nor checkpoints.stop_if_diverged's probe: one prompt, every logit checked)
    whole = [(length, positions) for sequences, positions, length in passes if sequences > 1 and positions > 1]
    # per update: the policy's and the reference's scoring passes, and 2 epochs of training passes
    assert len(whole) >= 2 * 3 and all(positions <= 16 + 1 < length for length, positions in whole), whole


def test_entropy_from_logits():
    assert math.isclose(rloo.entropy_from_logits(torch.zeros(5)).item(), math.log(5), rel_tol=1e-6)
    p = torch.tensor([0.25, 0.75])
    assert math.isclose(rloo.entropy_from_logits(p.log()).item(), -(p * p.log()).sum().item(), rel_tol=1e-6)


def test_masked_mean_ignores_padding():
    values = torch.tensor([[1.0, 2.0, 100.0], [3.0, 100.0, 100.0]])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert rloo.masked_mean(values, mask).item() == 2.0


def test_prompt_batches_cover_an_epoch_without_repeats_and_split_between_ranks():
    seen = []
    for update in range(3):  # 3 batches of 2 ranks x 2 prompts = 12 of 13 prompts
        shares = [data.prompt_batch(13, 2, update, seed=7, rank=r, world_size=2) for r in range(2)]
        assert all(len(s) == 2 for s in shares)
        seen += shares[0] + shares[1]
    assert len(set(seen)) == 12
    next_epoch = data.prompt_batch(13, 2, 3, seed=7, rank=0, world_size=2)
    assert next_epoch == data.prompt_batch(13, 2, 3, seed=7, rank=0, world_size=2)  # deterministic
    assert data.prompt_batch(13, 2, 0, seed=8, rank=0, world_size=2) != data.prompt_batch(13, 2, 0, 7, 0, 2)


def test_missing_eos_penalty_is_added_only_without_a_stop_token():
    responses = torch.tensor([[5, STOP, PAD], [5, 6, 7], [STOP, PAD, PAD]])
    scores = rloo.apply_missing_eos_penalty(torch.tensor([1.0, 2.0, -0.5]), responses, STOP, -1.0, "add")
    assert scores.tolist() == [1.0, 1.0, -0.5]


def test_missing_eos_penalty_adds_or_replaces():
    scores = torch.tensor([0.5, 2.0, -3.0])
    responses = torch.tensor([[5, 0, 1], [5, 6, 7], [0, 1, 1]])  # stop token 0: the second has none
    added = rloo.apply_missing_eos_penalty(scores, responses, 0, -1.0, "add")
    replaced = rloo.apply_missing_eos_penalty(scores, responses, 0, -1.0, "replace")
    assert added.tolist() == [0.5, 1.0, -3.0]  # TRL: 2.0 - 1
    assert replaced.tolist() == [0.5, -1.0, -3.0]  # the paper's code: the score becomes -1


def tiny_policy():
    """The tiny task's SFT policy (GPT-NeoX) on 8 real prompts of different lengths; it stops at EOS."""
    tokenizer = data.load_tokenizer(os.path.join(TINY, "sft"), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft")).eval()
    with open(os.path.join(TINY, "data", "test.jsonl")) as f:
        prompts = [json.loads(line)["query"] for line in f][:8]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"][-10 - i:] for i, p in enumerate(prompts)]
    return model, data.left_pad(ids, tokenizer.pad_token_id, "cpu"), tokenizer.pad_token_id, tokenizer.eos_token_id


def random_llama():
    """A random Llama with a vocabulary of 12, so that its stop token (3) comes early in some responses."""
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=12, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=2, max_position_embeddings=64)).eval()
    queries = torch.randint(4, 12, (6, 7))
    queries[:3, :2] = 0  # left padding
    return model, queries, 0, 3


@pytest.mark.parametrize("temperature", [0.7, None], ids=["sampled", "greedy"])
@pytest.mark.parametrize("make", [tiny_policy, random_llama], ids=["gpt_neox", "llama"])
def test_generate_gives_the_tokens_of_hf_generate(make, temperature):
    model, queries, pad, stop = make()
    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else dict(do_sample=False)
    for seed in range(3):
        torch.manual_seed(seed)
        ours = rloo.generate(model, queries, pad, stop, 24, temperature)
        torch.manual_seed(seed)
        theirs = model.generate(input_ids=queries, attention_mask=queries != pad, max_new_tokens=24,
                                eos_token_id=stop, pad_token_id=pad, **sampling)[:, queries.shape[1]:]
        assert torch.equal(ours, theirs)
    if temperature or make is tiny_policy:  # some responses stop early: padding follows their stop token
        assert (ours == stop).any(1).any() and (ours == pad).any()


@pytest.fixture
def process_group(monkeypatch):
    """A one-process group in this process: yields a function that (re)initialises it with a backend string."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for name, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port)).items():
        monkeypatch.setenv(name, value)

    def destroy():  # through DeepSpeed once it has used the group: it also forgets the groups it made from it
        if deepspeed.comm.is_initialized():
            deepspeed.comm.destroy_process_group()
        elif dist.is_initialized():
            dist.destroy_process_group()

    def init(backend):
        destroy()
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)

    yield init
    destroy()


def test_collectives_on_cpu_tensors_need_a_cpu_backend_beside_nccl(process_group):
    # NCCL serves CUDA tensors only. "cuda:gloo" stands in for it here: a group with a backend for
    # CUDA and none for the CPU, which fails on a CPU tensor exactly as NCCL does on a GPU machine.
    process_group("cuda:gloo")
    with pytest.raises(RuntimeError, match="No backend type associated with device type cpu"):
        distributed.mean_over_ranks({"objective/scores": 1.5}, "cpu")
    # The scripts' backend on a GPU machine (gloo in NCCL's place, which this machine lacks) serves
    # both the collectives on the device and those on CPU objects (the run name, the vLLM batches).
    assert distributed.process_group_backend(cuda=True) == "cpu:gloo,cuda:nccl"
    assert distributed.process_group_backend(cuda=False) == "gloo"
    process_group(distributed.process_group_backend(cuda=True).replace("nccl", "gloo"))
    assert distributed.mean_over_ranks({"objective/scores": 1.5, "objective/kl": -2.0}, "cpu") == {
        "objective/scores": 1.5, "objective/kl": -2.0}
    objects = [None]
    dist.broadcast_object_list(objects, src=0)
    dist.barrier()


def test_every_script_initialises_through_the_same_backend_choice():
    for path in glob.glob(os.path.join(ROOT, "*.py")):
        with open(path) as f:
            source = f.read()
        if "init_distributed(" in source:
            assert "dist_backend=process_group_backend(torch.cuda.is_available())" in source, path
            # No other process group is NCCL-only ("nccl" elsewhere names vLLM's weight transfer backend).
            assert not re.search(r'(backend=|init_process_group\()"nccl"', source), path


PLACEMENT = {
    # deepspeed --num_gpus 3 on 4 GPUs: the launcher shows the ranks only their 3 GPUs and sets LOCAL_SIZE.
    "deepspeed 3 of 4": ({"CUDA_VISIBLE_DEVICES": "0,1,2", "LOCAL_SIZE": "3", "LOCAL_RANK": "0"}, 4, None, ("3", None)),
    # deepspeed --include localhost:4,5,6 on 8 GPUs: the first GPU no rank uses.
    "deepspeed include 4-6 of 8": ({"CUDA_VISIBLE_DEVICES": "4,5,6", "LOCAL_SIZE": "3"}, 8, None, ("0", None)),
    # torchrun --nproc-per-node 3 on 4 GPUs: every GPU visible, ranks on the first 3.
    "torchrun 3 of 4": ({"LOCAL_WORLD_SIZE": "3", "LOCAL_RANK": "0"}, 4, None, ("3", None)),
    # deepspeed on all 8 GPUs: no GPU is free, vLLM shares rank 0's.
    "deepspeed 8 of 8": ({"CUDA_VISIBLE_DEVICES": ",".join(map(str, range(8))), "LOCAL_SIZE": "8"}, 8, None, ("0", 0)),
    # python with CUDA_VISIBLE_DEVICES=4 on an 8-GPU node: stay inside what the user made visible.
    "python, CUDA_VISIBLE_DEVICES=4": ({"CUDA_VISIBLE_DEVICES": "4"}, 8, None, ("4", 0)),
    "python, CUDA_VISIBLE_DEVICES=4,5": ({"CUDA_VISIBLE_DEVICES": "4,5"}, 8, None, ("5", None)),
    "python, one GPU": ({}, 1, None, ("0", 0)),
    "python, 2 GPUs": ({}, 2, None, ("1", None)),
    # UUID and MIG entries are passed on as they are; CUDA (not NVML) reads them.
    "torchrun on 2 UUIDs": ({"CUDA_VISIBLE_DEVICES": "GPU-8a1f,GPU-77c2", "LOCAL_WORLD_SIZE": "1"}, 8, None,
                            ("GPU-77c2", None)),
    "python on a MIG slice": ({"CUDA_VISIBLE_DEVICES": "MIG-4b2e"}, 8, None, ("MIG-4b2e", 0)),
    # --vllm-gpu wins; naming rank 0's GPU shares it.
    "--vllm-gpu 7": ({"CUDA_VISIBLE_DEVICES": "0,1,2", "LOCAL_SIZE": "3"}, 8, 7, ("7", None)),
    "--vllm-gpu 0 (rank 0's)": ({"CUDA_VISIBLE_DEVICES": "0,1,2", "LOCAL_SIZE": "3"}, 4, 0, ("0", 0)),
}


@pytest.mark.parametrize("case", PLACEMENT)
def test_vllm_gpu_placement_over_the_launch_cases(case):
    env, num_gpus, vllm_gpu, expected = PLACEMENT[case]
    assert distributed.vllm_gpu_placement(env, num_gpus, vllm_gpu) == expected
    # CUDA_DEVICE_ORDER changes how CUDA numbers GPUs against NVML; the choice is in CUDA's own
    # entries and uses NVML only for the count, so it is the same under either order.
    for order in ("PCI_BUS_ID", "FASTEST_FIRST"):
        assert distributed.vllm_gpu_placement({**env, "CUDA_DEVICE_ORDER": order}, num_gpus, vllm_gpu) == expected


def test_a_checkpoint_from_another_kind_of_device_resumes_without_its_generator_state(tmp_path, process_group):
    """A checkpoint written on a GPU, resumed on a CPU: the accelerator's generator state (CUDA's Philox, 16 bytes)
    fits no CPU generator, which would refuse it after DeepSpeed had loaded; torch's own CPU state is restored."""
    process_group("gloo")
    (tmp_path / "training_state").mkdir()
    saved = torch.manual_seed(7).get_state()
    torch.save({"torch": saved, "accelerator": torch.zeros(16, dtype=torch.uint8), "device": "cuda"},
               tmp_path / "training_state" / "rng_rank0.pt")
    (tmp_path / "trainer_state.json").write_text('{"update": 2, "episode": 64}')
    torch.manual_seed(0)
    assert checkpoints.load_checkpoint(str(tmp_path), {}) == (2, 64)
    assert torch.equal(torch.get_rng_state(), saved)


def test_the_divergence_check_reads_a_zero3_partition_but_not_its_padding(tmp_path, process_group, monkeypatch):
    """Under ZeRO-3 each rank holds a partition of every parameter (ds_tensor); the last ranks' end in padding that
    DeepSpeed allocates and never writes (torch.empty), which may read as NaN: the check reads the parameter's elements
    only, so garbage in the padding passes and a NaN in the parameter stops the run."""
    process_group("gloo")
    assert [checkpoints.partition_elements(10, 4, rank) for rank in range(4)] == [4, 4, 2, 0]
    layer = torch.nn.Linear(3, 3, bias=False)  # 9 elements, a partition of 4 on rank 2 of 3: 1 element and 3 of padding
    weight = layer.weight
    weight.ds_numel, weight.ds_process_group = 9, None
    weight.ds_tensor = torch.tensor([0.5, float("nan"), float("inf"), float("nan")])
    engine = types.SimpleNamespace(module=layer)
    monkeypatch.setattr(checkpoints.dist, "get_rank", lambda group=None: 2)
    checkpoints.stop_if_diverged({"value": engine}, [1], 3, str(tmp_path), 1e-5)  # garbage in the padding: goes on
    weight.ds_tensor[0] = float("nan")
    with pytest.raises(SystemExit) as exit:
        checkpoints.stop_if_diverged({"value": engine}, [1], 3, str(tmp_path), 1e-5)
    assert exit.value.code == 1


def test_a_signal_while_a_checkpoint_is_written_leaves_no_partial_one(tmp_path, process_group, monkeypatch):
    """SIGTERM exits through sys.exit (generator.exit_on_signals), wherever the run is: in the middle of writing a
    checkpoint, its temporary directory goes with it, as it does when the disk is full."""
    process_group("gloo")

    def terminated(*args, **kwargs):
        raise SystemExit(128 + 15)

    monkeypatch.setattr(checkpoints.torch, "save", terminated)  # the signal arrives as the RNG state is written
    args = online_dpo_vllm.Args(sft_model_path=os.path.join(TINY, "sft"))
    with pytest.raises(SystemExit) as exit:
        checkpoints.save_checkpoint(args, str(tmp_path), 4, 256, {})
    assert exit.value.code == 143 and os.listdir(tmp_path) == []


def test_a_disk_that_fills_as_the_weights_are_written_ends_in_one_line(tmp_path, process_group):
    """A disk that holds DeepSpeed's state (written first) but not the safetensors file of the weights after it: the
    error safetensors raises (not an OSError; stop 74's CI met it on SmolLM2) ends the run in the full-disk line too,
    the partial checkpoint removed. The disk's size comes from a checkpoint written first where there is room."""
    process_group("gloo")
    args = rloo.Args(sft_model_path=os.path.join(TINY, "sft"), bf16=False, num_updates=1)
    engine = trained_engine(args, data.load_model(args, os.path.join(TINY, "sft"), trained=True))
    checkpoints.save_checkpoint(args, str(tmp_path), 1, 64, {"policy": engine})
    written = tmp_path / "checkpoint-1"
    pages = {str(path.relative_to(written)): -(-path.stat().st_size // 4096) for path in written.rglob("*")
             if path.is_file()}
    disk = tmp_path / "disk"
    disk.mkdir()
    size = sum(pages.values()) - pages["model.safetensors"] // 2  # all but half of the weights' file
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size * 4}k", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(SystemExit) as exit:
            checkpoints.save_checkpoint(args, str(disk), 2, 128, {"policy": engine})
        left = os.listdir(disk)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert str(exit.value.code).startswith(f"error: could not write {disk}/checkpoint-2 (Error while serializing: "
                                           "I/O error: No space left on device"), exit.value.code
    assert left == []


def test_a_disk_that_fills_as_weights_are_handed_to_vllm_ends_in_one_line(tmp_path, process_group, capsys):
    """The weights of a hand-off through files (to /dev/shm, shared by every process of the machine, or to the run
    directory) on a disk that fills (1 MiB for the tiny policy's 2.2 MB): one line naming the path, the update and
    the checkpoint to resume from, exit code 1, the partial version removed."""
    process_group("gloo")
    args = rloo.Args(sft_model_path=os.path.join(TINY, "sft"), bf16=False, num_updates=1)
    engine = trained_engine(args, data.load_model(args, os.path.join(TINY, "sft"), trained=True))
    disk, run_dir = tmp_path / "disk", tmp_path / "run"
    disk.mkdir()
    (run_dir / "checkpoint-2").mkdir(parents=True)
    hand_off = generator.AsyncGeneration.__new__(generator.AsyncGeneration)  # its state at a hand-off after update 3
    hand_off.rank, hand_off.run_dir, hand_off.update, hand_off.weights_dir = 0, str(run_dir), 3, str(disk)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        with pytest.raises(SystemExit) as exit:
            hand_off.save_weights(engine, str(disk / "policy-3"))
        left = os.listdir(disk)
    finally:
        subprocess.run(["umount", str(disk)], check=True)
    assert exit.value.code == 1 and left == []
    stderr = capsys.readouterr().err
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]  # (after save_pretrained's bar)
    assert "Traceback" not in stderr and line.startswith(f"error: could not write the weights handed to vLLM to {disk}/policy-3 (Error while "
                           "serializing: I/O error: No space left on device") and line.endswith(
        f"(update 3); resume with --resume {run_dir}/checkpoint-2"), line


def test_every_rank_resumes_from_rank_0s_latest_checkpoint(tmp_path):
    """Nodes sharing a run directory may list it differently for a while (NFS caches listings): a rank whose listing
    still names an older checkpoint must load rank 0's, or the ranks would resume at different updates."""
    for update in (2, 3):
        (tmp_path / f"checkpoint-{update}" / "training_state").mkdir(parents=True)
        for rank in (0, 1):
            state = torch.manual_seed(update).get_state()
            torch.save({"torch": state, "accelerator": state, "device": "cpu"},
                       tmp_path / f"checkpoint-{update}" / "training_state" / f"rng_rank{rank}.pt")
        (tmp_path / f"checkpoint-{update}" / "trainer_state.json").write_text(
            json.dumps({"update": update, "episode": 32 * update}))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    code = ("import sys, torch.distributed as dist, checkpoints\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:' + sys.argv[1], rank=int(sys.argv[2]),"
            " world_size=2)\n"
            "print(checkpoints.load_checkpoint(sys.argv[3], {}))")
    ranks = [subprocess.Popen([sys.executable, "-c", code, str(port), str(rank), str(tmp_path / f"checkpoint-{seen}")],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, seen in ((0, 3), (1, 2))]  # rank 1's listing lags one checkpoint behind
    outputs = [rank.communicate(timeout=120) for rank in ranks]
    assert [out.strip().splitlines()[-1:] for out, _ in outputs] == [["(3, 96)"], ["(3, 96)"]], outputs


def test_vllm_may_share_no_training_gpu_but_rank_0s(capsys):
    """Rank 0's process measures vLLM's memory, empties its allocator for vLLM and holds the learner to the rest: on
    another rank's GPU it would do none of that for the rank that trains there."""
    with pytest.raises(SystemExit) as exit:
        distributed.vllm_gpu_placement({"CUDA_VISIBLE_DEVICES": "0,1,2", "LOCAL_SIZE": "3"}, 4, 1)
    assert exit.value.code == 2
    assert capsys.readouterr().err == "error: --vllm-gpu: GPU 1 is training rank 1's: vLLM may share rank 0's only\n"


def test_vllm_memory_share_on_a_gpu_shared_with_training(capsys):
    gib = 2**30
    # half of what is free, rounded down; the learner's allocator is held to the rest but vLLM's CUDA context (1 GiB
    # kept), the learner's own (0.5 GiB) and what loading new weights takes in vLLM beyond its share (here 2 GiB)
    assert vllm_engine.vllm_memory_share(None, 60 * gib, 80 * gib, "0", 2 * gib, 0) == (0.37, 1 - 0.37 - 3.5 / 80)
    assert vllm_engine.vllm_memory_share(0.5, 60 * gib, 80 * gib, "0", 0, 0) == (0.5, 1 - 0.5 - 1.5 / 80)  # a share that fits
    # vLLM would refuse to start (it measures once its CUDA context, about 0.5 GiB, is made); we stop first
    for requested, free in ((0.9, 60 * gib), (0.74, 60 * gib), (None, 1.5 * gib)):
        with pytest.raises(SystemExit) as exit:
            vllm_engine.vllm_memory_share(requested, free, 80 * gib, "0", 0, 0)
        assert exit.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: --vllm-gpu-memory-utilization: GPU 0, shared with training, has")
    # A share that leaves the learner less than its allocator holds (or a negative fraction, which torch refuses with
    # a traceback): one line. 0.7 of 80 GiB with 2 GiB of hand-off leaves 80 - 56 - 3.5 = 20.5 GiB.
    assert vllm_engine.vllm_memory_share(0.7, 70 * gib, 80 * gib, "0", 2 * gib, 20 * gib)[1] * 80 == pytest.approx(20.5)
    for held, hand_off in ((21 * gib, 2 * gib), (0, 30 * gib)):
        with pytest.raises(SystemExit) as exit:
            vllm_engine.vllm_memory_share(0.7, 70 * gib, 80 * gib, "0", hand_off, held)
        assert exit.value.code == 2
        (line,) = capsys.readouterr().err.splitlines()
        assert line.startswith("error: --vllm-gpu-memory-utilization: GPU 0, shared with training: vLLM's share of "
                               "0.70 and its hand-off leave the learner "), line


def test_vllm_on_a_gpu_of_its_own_leaves_room_for_loading_new_weights():
    """What a hand-off takes in vLLM's process beyond its share: layer-wise reload's copy of a (fused) layer, up to
    twice the largest parameter or a decoder layer's parameters (a fused MoE layer's experts), and received in memory
    packed chunks, each its buffer overshot by up to one parameter: two over NCCL (vLLM's receiver allocates a chunk's
    buffer before it drops the last one's), one over CUDA IPC (its clones). A 1.5 B tied model (Qwen2.5-1.5B: a
    151936 x 1536 bf16 embedding, 467 MB) on a 24 GiB GPU of vLLM's own: 6 x 467 MB over NCCL; a small model keeps
    0.9 less a hundredth; a Mixtral-like MoE layer (8 experts of 3 x 4096 x 14336 bf16) reloads 2.8 GB at once."""
    gib, largest = 2**30, 151936 * 1536 * 2
    qwen = {"model.embed_tokens.weight": largest, "model.layers.0.mlp.gate_proj.weight": 8960 * 1536 * 2}
    assert vllm_engine.hand_off_bytes(qwen, received="nccl") == 6 * largest
    assert vllm_engine.hand_off_bytes(qwen, received="ipc") == 4 * largest
    assert vllm_engine.hand_off_bytes(qwen, received=None) == 2 * largest  # files: the reload only
    assert vllm_engine.hand_off_bytes({"w": 1000}, received="nccl") == 2000 + 2 * (256 * 2**20 + 1000)  # 256 MiB floor
    assert vllm_engine.own_gpu_share(None, 24 * gib, vllm_engine.hand_off_bytes(qwen, "nccl")) == 0.79
    assert vllm_engine.own_gpu_share(None, 80 * gib, vllm_engine.hand_off_bytes({"w": 10**6}, "nccl")) == 0.89
    assert vllm_engine.own_gpu_share(0.95, 24 * gib, 6 * largest) == 0.95  # --vllm-gpu-memory-utilization wins
    expert = 4096 * 14336 * 2
    mixtral = {"model.embed_tokens.weight": 32000 * 4096 * 2, **{
        f"model.layers.{layer}.block_sparse_moe.experts.{e}.w{w}.weight": expert
        for layer in range(2) for e in range(8) for w in (1, 2, 3)}}
    assert vllm_engine.largest_layer_bytes(mixtral) == 24 * expert  # one layer's experts, not the two layers'
    assert vllm_engine.hand_off_bytes(mixtral, received=None) == 24 * expert  # not twice the largest, 2 x 262 MB


def test_the_weight_check_fails_on_a_gpu_when_its_rule_for_fused_tensors_is_wrong(monkeypatch, capsys):
    """The weight check compares the digests vLLM holds alike when it starts. On a GPU that is every tensor, the fused
    ones included: a wrong rule for fusing (here v left out of qkv_proj) must stop the run, not silently drop the
    tensor from every later check. On a CPU, where vLLM repacks its linear layers, they are left out, and it says so."""
    model = LlamaForCausalLM(LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                         num_attention_heads=4, num_key_value_heads=2))
    held = weight_handoff.weight_digests(model.named_parameters())  # what vLLM on CUDA reports: the right fusion
    held = {name: digest for name, digest in held.items() if not re.search(r"\.(q|k|v|gate|up)_proj\.", name)}
    assert weight_handoff.digests_to_check(weight_handoff.weight_digests(model.named_parameters()), held, True)
    assert "digests of 9 of 14 tensors (5 left out: vLLM fuses them or does not hold them" in capsys.readouterr().out
    broken = ((re.compile(r"(.*)\.[qk]_proj\.(weight|bias)$"), r"\1.qkv_proj.\2"), weight_handoff.FUSED[1])
    monkeypatch.setattr(weight_handoff, "FUSED", broken)
    expected = weight_handoff.weight_digests(model.named_parameters())
    with pytest.raises(weight_handoff.WeightsDiffer, match=r"does not give vLLM's digest of model\.layers\.0\.self_"
                                                          r"attn\.qkv_proj\.weight: fix the rule"):
        weight_handoff.digests_to_check(expected, held, on_gpu=True)
    names = weight_handoff.digests_to_check(expected, held, on_gpu=False)
    assert "model.layers.0.self_attn.qkv_proj.weight" not in names and "model.embed_tokens.weight" in names
    assert "left out: vLLM repacks them for its CPU kernels" in capsys.readouterr().out


@pytest.mark.parametrize("bf16", [True, False])
def test_the_lora_weight_check_wants_vllm_nearer_the_learner_than_the_base(bf16):
    """Under an adapter, vLLM's probe log-probabilities must be closer to the learner's than to the base model's (the
    adapter off) once the adapter has moved them past ADAPTER_MOVED: a young adapter that vLLM does not apply, or
    applies in part, passes the tolerance (0.25 in bfloat16) but not this."""
    moved, noise = (0.15, 0.05) if bf16 else (6e-4, 5e-6)  # both within PROBE_TOLERANCE
    assert moved < weight_handoff.PROBE_TOLERANCE[bf16] and moved > weight_handoff.ADAPTER_MOVED[bf16]
    base = [-2.0, -1.0, -0.5, -3.0]
    learner = [b + moved for b in base]
    follows = weight_handoff.follows_the_adapter
    assert follows([x + noise for x in learner], learner, base, bf16)  # applied: within noise of the learner
    assert not follows([b + noise for b in base], learner, base, bf16)  # not applied: the base's, within noise
    assert not follows([b + 0.4 * moved for b in base], learner, base, bf16)  # applied in part (40 %)
    young = [b + weight_handoff.ADAPTER_MOVED[bf16] / 2 for b in base]  # within noise of the base: not judged
    assert follows(base, young, base, bf16)


def test_the_weight_check_digests_vllms_fused_tensors_from_the_learners_parts():
    """On CUDA vLLM keeps q/k/v as one qkv_proj and gate/up as one gate_up_proj, byte for byte: digests of those names
    only (what vLLM's compute_weight_checksums reports) would leave most of each decoder layer unchecked. The learner
    digests each fused tensor from its parts in vLLM's order, so a stale part is found."""
    import hashlib

    config = LlamaConfig(vocab_size=50, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, attention_bias=True)
    model = LlamaForCausalLM(config)
    attention, mlp = model.model.layers[1].self_attn, model.model.layers[1].mlp

    def sha256(*parts):  # of the fused tensor, as vLLM builds it: the parts concatenated along the output dimension
        return hashlib.sha256(torch.cat(parts).detach().contiguous().view(-1).view(torch.uint8).numpy()).hexdigest()

    digests = weight_handoff.weight_digests(model.named_parameters())
    qkv, gate_up = "model.layers.1.self_attn.qkv_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"
    assert digests[qkv] == sha256(attention.q_proj.weight, attention.k_proj.weight, attention.v_proj.weight)
    assert digests["model.layers.1.self_attn.qkv_proj.bias"] == sha256(attention.q_proj.bias, attention.k_proj.bias,
                                                                       attention.v_proj.bias)
    assert digests[gate_up] == sha256(mlp.gate_proj.weight, mlp.up_proj.weight)
    assert weight_handoff.fused_name("model.layers.1.self_attn.o_proj.weight") is None
    assert weight_handoff.fused_name("model.layers.1.mlp.down_proj.weight") is None

    class Engine:  # what expected_weights reads of a DeepSpeed engine
        def __init__(self, module):
            self.module = module

        def __call__(self, **inputs):
            return self.module(**inputs)

    expected = weight_handoff.expected_weights(Engine(model), [[1, 2, 3]], [qkv, gate_up], 49, "cpu")
    assert expected.digests == {qkv: digests[qkv], gate_up: digests[gate_up]}
    with torch.no_grad():
        attention.v_proj.weight[0, 0] += 1  # a part that failed to load
    assert weight_handoff.expected_weights(Engine(model), [[1, 2, 3]], [qkv], 49, "cpu").digests[qkv] != digests[qkv]


def test_cuda_ipc_only_with_one_training_rank():
    """vLLM's IPC trainer engine exports a packing buffer on every training rank and its one worker imports rank 0's:
    torch keeps an exported block allocated until a consumer releases it, so every other rank would strand one per
    update. With vLLM on rank 0's GPU and several training ranks, the weights go through files."""
    assert vllm_engine.in_memory_backend(None, 1) == vllm_engine.in_memory_backend(None, 8) == "nccl"  # its own GPU
    assert vllm_engine.in_memory_backend(0, 1) == "ipc"
    assert vllm_engine.in_memory_backend(0, 2) is None


def test_an_asynchronous_run_binds_every_thread_of_vllms_processes_to_vllms_cores():
    """A child process with several threads stands for vLLM's engine processes, a thread named as vLLM's for its
    output thread in the learner's process, and a thread calling the helper for the generator."""
    import subprocess
    import threading
    from types import SimpleNamespace

    cores = sorted(os.sched_getaffinity(0))
    child = subprocess.Popen([sys.executable, "-c", "import threading, time\n"
                              "for _ in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
                              "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    stop = threading.Event()
    output_thread = threading.Thread(target=stop.wait, name="EngineCoreOutputQueueThread", daemon=True)
    output_thread.start()

    def as_generator(sync):
        affinity = []
        caller = threading.Thread(target=lambda: (vllm_engine.pin_vllm_to_its_cores(
            SimpleNamespace(sync=sync, vllm_cpu_cores=1)), affinity.append(os.sched_getaffinity(0))))
        caller.start()
        caller.join()
        return affinity[0]

    try:
        assert child.stdout.readline() == "ready\n"
        threads = [int(tid) for tid in os.listdir(f"/proc/{child.pid}/task")] + [output_thread.native_id]
        assert len(threads) == 5
        assert as_generator(sync=True) == set(cores)  # --sync: vLLM left free
        assert [os.sched_getaffinity(tid) for tid in threads] == [set(cores)] * 5
        assert as_generator(sync=False) == {cores[-1]}
        assert [os.sched_getaffinity(tid) for tid in threads] == [{cores[-1]}] * 5
        assert os.sched_getaffinity(0) == set(cores)  # the learner's own threads keep their cores
    finally:
        stop.set()
        child.kill()
        child.wait()


def test_handed_over_weights_fall_back_to_the_run_directory_when_memory_is_short(tmp_path, capsys):
    shm, run_dir = tmp_path / "shm", str(tmp_path / "run")
    shm.mkdir()
    assert weight_handoff.weights_root(run_dir, 10 * 2**20, shm=str(shm)) == str(shm)
    assert capsys.readouterr().err == ""
    assert weight_handoff.weights_root(run_dir, 2**62, shm=str(shm)) == run_dir  # more than any disk holds
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"warning: {shm} has no room for") and run_dir in line
    assert weight_handoff.weights_root(run_dir, 1, shm=str(tmp_path / "none")) == run_dir  # no /dev/shm at all


def test_zero3_weights_are_gathered_one_module_at_a_time(process_group, tmp_path, monkeypatch):
    process_group("gloo")
    config = {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "gradient_clipping": 1.0}
    (tmp_path / "zero3.json").write_text(json.dumps(config))
    args = online_dpo_vllm.Args(deepspeed_config=str(tmp_path / "zero3.json"), bf16=False)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    largest_module = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum(p.numel() for p in model.parameters())
    engine = deepspeed.initialize(model=model, config=distributed.ds_config(args, train=False))[0]
    assert all(p.numel() == 0 for p in engine.module.parameters())  # partitioned: nothing is whole
    gathered, original = [], deepspeed.zero.GatheredParameters

    def recording(params, *a, **k):
        gathered.append(sum(p.ds_numel for p in params))
        return original(params, *a, **k)

    monkeypatch.setattr(deepspeed.zero, "GatheredParameters", recording)
    state = distributed.gathered_state_dict(engine)  # the file hand-off and checkpoints
    assert state.keys() == expected.keys()
    assert all(torch.equal(state[name], expected[name]) for name in expected)
    assert max(gathered) == largest_module < total / 3  # the embeddings, never the whole model
    # The in-memory hand-off streams the parameters the same way, declaring their full shapes first.
    gathered.clear()
    weights = weight_handoff.PolicyWeights(engine.module)
    parameters = dict(model.named_parameters())
    assert [(m.name, m.shape) for m in weights.metadata] == [(n, tuple(p.ds_shape)) for n, p in parameters.items()]
    streamed = dict(iter(weights))
    assert streamed.keys() == parameters.keys()
    assert all(torch.equal(streamed[name], expected[name]) for name in streamed)
    assert max(gathered) == largest_module and len(gathered) > 4
    assert all(p.numel() == 0 for p in engine.module.parameters())  # released after each module



def test_gradient_checkpointing_recomputes_in_training_and_generates_with_the_kv_cache(process_group):
    """transformers checkpoints only a model in training mode, and there drops the KV cache that generate() uses. With
    --gradient-checkpointing the policy trains in training mode (each layer runs again in the backward pass, with the
    same log-probabilities: dropout is off) and generates in eval mode (the same tokens as without it)."""
    process_group("gloo")
    plain, queries, pad, stop = tiny_policy()
    args = rloo.Args(gradient_checkpointing=True, bf16=False, num_updates=1)
    engine = trained_engine(args, data.load_model(args, os.path.join(TINY, "sft"), trained=True))
    runs = []
    engine.module.gpt_neox.layers[0].register_forward_pre_hook(lambda *_: runs.append(1))  # each time the layer runs
    responses, n = rloo.generate(plain, queries, pad, stop, 8), queries.shape[1]  # greedy
    ids = torch.cat([queries, responses], 1)
    ours = rloo.response_logprobs(rloo.response_logits(engine, ids, pad, n), responses, 1.0)
    ours.sum().backward()
    assert engine.module.training and len(runs) == 2  # the forward, and its recomputation in the backward pass
    with torch.no_grad():
        theirs = rloo.response_logprobs(rloo.response_logits(plain, ids, pad, n), responses, 1.0)
    assert torch.allclose(ours, theirs, atol=1e-6)
    with distributed.unwrapped_for_generation(engine) as model:
        assert torch.equal(rloo.generate(model, queries, pad, stop, 8), responses)
    assert engine.module.training  # training mode again after generating



def test_loaded_models_have_no_dropout_even_in_training_mode(tmp_path):
    """Dropout would make the log-probabilities of the same tokens disagree (learner, reference, vLLM). load_model turns
    off the dropout modules and the attention's own dropout probability, which a model applies in training mode only
    (the policy's mode under --gradient-checkpointing)."""
    config = LlamaConfig(vocab_size=12, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                         attention_dropout=0.5)
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = data.load_model(rloo.Args(bf16=False), str(tmp_path)).train()
    ids = torch.randint(0, 12, (4, 9))
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)


@pytest.mark.parametrize("lora_rank", [0, 8], ids=["full", "lora"])
def test_ppos_value_model_accumulates_every_micro_batch_under_zero3(process_group, tmp_path, lora_rank):
    """value_forward runs the value model's parts (per-token values), not its DeepSpeed engine's forward, whose first
    step ZeRO-3 needs to count micro-batches: without it, each micro-batch's gradient replaced the last one's and only
    the last trained. With two accumulated micro-batches, ZeRO-3 must take ZeRO-2's step. With LoRA the value model
    is a peft sequence classifier (an adapter and its whole score head train), and ZeRO-3 gathers those alone."""
    import ppo

    process_group("gloo")
    torch.manual_seed(0)
    ids = torch.randint(3, 600, (4, 12))
    weights = {}
    for stage in (2, 3):
        (tmp_path / f"zero{stage}.json").write_text(json.dumps({"zero_optimization": {"stage": stage}}))
        args = ppo.Args(deepspeed_config=str(tmp_path / f"zero{stage}.json"), bf16=False, num_updates=1,
                        per_device_train_batch_size=2, gradient_accumulation_steps=2, learning_rate=1e-3,
                        lora_rank=lora_rank)
        model = data.load_model(args, os.path.join(TINY, "reward"), reward=True)
        torch.manual_seed(1)  # the same initial adapter in both
        engine = trained_engine(args, data.with_lora(args, model) if lora_rank else model)
        for micro_batch in (ids[:2], ids[2:]):
            engine.backward(ppo.value_forward(engine, micro_batch, 1, 6).pow(2).mean())
            engine.step()
        weights[stage] = distributed.gathered_state_dict(engine)
    assert max((weights[3][name] - weights[2][name]).abs().max().item() for name in weights[3]) < 1e-6
    trained = {name for name, p in engine.module.named_parameters() if p.requires_grad}
    if lora_rank:
        assert "base_model.model.score.modules_to_save.default.weight" in trained
        assert all("lora_" in name or ".score." in name for name in trained) and weights[3].keys() == trained
        reward_head = data.load_model(args, os.path.join(TINY, "reward"), reward=True).score.weight
        assert (weights[3]["base_model.model.score.modules_to_save.default.weight"] - reward_head).abs().max() > 1e-5
    else:
        assert weights[3].keys() == weights[2].keys()
        # ZeRO-3 equal to ZeRO-2 is no proof that either trained: every weight, the body's as the score head's, took
        # Adam's first step, lr g / (|g| + eps) at each element, so its largest change is at most the learning rate
        # (1e-3) and near it (0.98e-3 to 1.0e-3 seen).
        initial = dict(data.load_model(args, os.path.join(TINY, "reward"), reward=True).named_parameters())
        moved = {name: (weights[3][name] - initial[name]).abs().max().item() for name in initial}
        assert "score.weight" in moved and "gpt_neox.embed_in.weight" in moved, sorted(moved)
        assert all(0.9e-3 < change < 1.001e-3 for change in moved.values()), moved

def test_each_rank_takes_the_device_of_its_local_rank_under_every_launcher(process_group, monkeypatch):
    """deepspeed's launcher gives the local rank as --local_rank and in LOCAL_RANK, torchrun in LOCAL_RANK only: on
    GPUs, every rank reading --local_rank's default 0 would put all ranks on GPU 0."""
    process_group("gloo")
    monkeypatch.setenv("LOCAL_RANK", "3")
    accelerator, asked = rloo.get_accelerator(), []
    name = accelerator.device_name
    monkeypatch.setattr(accelerator, "device_name", lambda index=None: asked.append(index) or name(index))
    distributed.set_up_distributed(rloo.Args(bf16=False))  # local_rank 0, as under torchrun
    assert asked == [3]


def test_the_generator_waits_for_new_weights_without_a_deadline():
    """The next version reaches the generator after the learner's update, evaluation and checkpoint, which may take
    longer than --generation-timeout: it waits until the version comes or the learner stops, not until a deadline."""
    args = online_dpo_vllm.Args(sync=True, generation_timeout=0.2, bf16=False, num_updates=3)
    kept = generator.GeneratedBatch(0, [[0]], [[]], [[]], 0, 0.0, 0.0)  # update 1's batch, from a checkpoint
    thread = generator.GenerationThread(args, None, online_dpo_vllm.sampling_params, online_dpo_vllm.generating_version,
                                        online_dpo_vllm.batch_prompts,
                                        weights_dir="unused", train_prompts=[[1]], prompts_per_rank=1, k=2, stop_id=0,
                                        first_version=0, off_policy_steps=0, probe=None, in_memory=False,
                                        resumed_batches=[kept])
    thread.start()
    assert thread.receivers.get(timeout=10) == 1  # update 2's batch waits for version 1
    time.sleep(1.0)  # five --generation-timeouts
    assert thread.error is None and thread.thread.is_alive()
    thread.stopping.set()
    thread.thread.join(timeout=5)
    assert str(thread.error) == "the learner stopped"

def _load_fresh(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


NAMES = [script.removesuffix(".py") for script in SCRIPTS]  # every script, found by its shape


@pytest.mark.parametrize("gpu", ["native", "emulated", "none"])
def test_bf16_is_the_default_only_on_a_gpu_that_has_it_natively(monkeypatch, capsys, gpu):
    """torch.cuda.is_bf16_supported() is True by emulation before compute capability 8.0 (T4, V100), where vLLM
    refuses bfloat16 and training crawls: the default and the guard of every script count native support only."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported",
                        lambda including_emulation=True: gpu == "native" or (gpu == "emulated" and including_emulation))
    for name in NAMES:
        module = _load_fresh(os.path.join(ROOT, f"{name}.py"), f"fresh_{name}")
        assert module.Args().bf16 is (gpu == "native"), name
        if gpu == "emulated":  # asked for anyway: one line naming the argument, before anything loads
            args = module.Args(bf16=True, checkpoints=os.path.join(TINY, "sft")) if name == "evaluate" else module.Args(bf16=True)
            args.world_size = 1
            with pytest.raises(SystemExit) as exit:
                module.validate(args)
            assert exit.value.code == 2 and capsys.readouterr().err.startswith("error: --bf16: this GPU has no native")


class FakeNvml:
    """NVML as a machine with NVIDIA GPUs shows it (the real one needs a driver)."""

    def __init__(self, gpus, driver="550.54.15"):
        self.gpus, self.driver = gpus, driver

    def nvmlInit(self):
        pass

    def nvmlDeviceGetCount(self):
        return self.gpus

    def nvmlSystemGetDriverVersion(self):
        return self.driver


@pytest.mark.parametrize("gpus", [2, 0])
def test_a_cuda_torch_that_cannot_use_the_machines_gpus_stops_every_script(monkeypatch, capsys, gpus):
    """A CUDA 13 torch (the registry's, which vLLM 0.32 needs) under an R550 driver: CUDA is unavailable and the
    scripts would train on the CPU without a word. With GPUs that NVML sees, every script stops first, in one line."""
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpus))
    for name in NAMES:
        module = importlib.import_module(name)
        if not gpus:  # no NVIDIA GPU: a CPU machine with a CUDA build of torch runs on the CPU, as asked
            checks.check_gpu_driver()
            continue
        with pytest.raises(SystemExit) as exit:
            module.validate(module.Args())
        error = capsys.readouterr().err
        assert exit.value.code == 2 and error.count("\n") == 1, (name, error)
        assert error.startswith("error: this torch is a CUDA 13.0 build, which needs NVIDIA driver R580 or newer; this "
                                "machine's 2 GPU(s) have driver 550.54.15"), error


class RecordedLLM:
    """vllm.LLM as start_vllm builds it on a GPU: the engine's arguments and the environment it starts in."""

    def __init__(self, **engine_args):
        self.engine_args, self.environ = engine_args, dict(os.environ)


@pytest.mark.parametrize("gpus, ranks", [(1, 1), (2, 1), (1, 2)], ids=["shared-ipc", "own-nccl", "shared-2-ranks"])
def test_vllm_on_a_gpu_starts_with_what_its_weight_hand_off_needs(tmp_path, monkeypatch, gpus, ranks):
    """start_vllm's GPU branch (vLLM's engine recorded, not started). On a GPU it shares with the learner (one GPU)
    vLLM takes CUDA IPC, whose update payload carries torch classes that vLLM's RPC pickles only with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1, set in the engine's environment at start and kept for the run's life;
    vLLM's share is chosen from free memory read after the learner's allocator gave back its cached blocks, and the
    learner's allocator is held to the rest."""
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: calls.append(("mem_get_info", index)) or
                        (40 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "set_per_process_memory_fraction", lambda *limit: calls.append(limit))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpus))
    monkeypatch.setattr(importlib.import_module("vllm"), "LLM", RecordedLLM)
    monkeypatch.setattr(vllm_engine, "reap_when_the_learner_dies", lambda llm: None)  # it starts no process
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "VLLM_ALLOW_INSECURE_SERIALIZATION"):
        monkeypatch.delenv(name, raising=False)
    args = online_dpo_vllm.Args(bf16=True)
    args.world_size, largest = ranks, 2**30  # the largest parameter: 1 GiB
    llm = vllm_engine.start_vllm(args, os.path.join(TINY, "sft"), weight_transfer=True, sizes={"embed": largest})
    backend = llm.engine_args.get("weight_transfer_config", {}).get("backend")
    assert llm.engine_args["dtype"] == "bfloat16"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ  # restored: only the engine's processes see it
    if gpus == 1:  # the learner keeps 1 - 0.25 less vLLM's context, its own, the reload's copy and (CUDA IPC) the
        # clones of a chunk: 1 + 0.5 + 2 (+ 2) GiB
        assert backend == ("ipc" if ranks == 1 else None) and llm.environ["CUDA_VISIBLE_DEVICES"] == "0"
        assert calls == ["empty_cache", ("mem_get_info", 0), (1 - 0.25 - (5.5 if ranks == 1 else 3.5) / 80, 0)]
        assert llm.engine_args["gpu_memory_utilization"] == 0.25
        if ranks == 1:
            assert llm.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
            assert os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] == "1"
    else:  # 0.9 less the reload's copy and two NCCL chunks: 2 + 2 x (1 + 1) GiB of 80
        assert backend == "nccl" and llm.environ["CUDA_VISIBLE_DEVICES"] == "1"
        assert calls == [("mem_get_info", 0)] and llm.engine_args["gpu_memory_utilization"] == 0.82
        assert "VLLM_ALLOW_INSECURE_SERIALIZATION" not in llm.environ  # NCCL's payload is names, dtypes, shapes


def test_vllms_rpc_carries_a_cuda_ipc_update_only_as_the_scripts_set_it_up(monkeypatch):
    """The CUDA IPC hand-off's update, as vLLM's IPC trainer engine builds it (the handle's arguments are those of
    torch's reduce_tensor for a CUDA tensor: tensor and storage classes, a dtype), through vLLM's own RPC encoder and
    decoder: refused without the setting, carried unchanged with it."""
    from vllm import envs
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    handle = (torch.Tensor, torch.Size([8, 4]), (4, 1), 0, torch.UntypedStorage, torch.bfloat16, 0, b"\x01" * 64,
              2**28, 0, False, b"\x02" * 16, 0, b"\x03" * 64, True)
    update = dataclasses.asdict(IPCWeightTransferUpdateInfo(
        names=["model.embed_tokens.weight"], dtype_names=["bfloat16"], shapes=[[8, 4]],
        ipc_handles={"GPU-0000": handle}, tensor_sizes=[64]))
    request = ("update_weights", ({"update_info": update},))
    envs.disable_envs_cache()  # read afresh, as in the scripts' process
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "0")
    with pytest.raises(TypeError, match="not serializable"):
        MsgpackEncoder().encode(request)
    vllm_engine.allow_pickled_rpc(os.environ)
    (decoded,) = MsgpackDecoder().decode(MsgpackEncoder().encode(request))[1]
    carried = decoded["update_info"]["ipc_handles"]["GPU-0000"]  # msgpack carries tuples as lists
    assert carried == [list(item) if isinstance(item, tuple) else item for item in handle]
    assert carried[0] is torch.Tensor and carried[4] is torch.UntypedStorage and carried[5] is torch.bfloat16


def test_the_hand_offs_packing_buffers_fit_the_largest_parameter_and_are_bounded(monkeypatch):
    """vLLM's CUDA IPC packer refuses a tensor larger than its buffer (1 GiB by default; Qwen2.5-7B's embedding in bf16
    is 1.04 GiB), and the NCCL engines keep two buffers on each side outside vLLM's memory share. The scripts give
    both engines 256 MiB buffers, or the largest parameter's size. (Parameters on the meta device: no memory.)"""
    class Model(torch.nn.Sequential):  # an embedding and a layer, as a model has them
        def get_input_embeddings(self):
            return self[0]

    large = Model(torch.nn.Embedding(152064, 3584, device="meta", dtype=torch.bfloat16),
                  torch.nn.Linear(64, 64, device="meta"))
    assert vllm_engine.packed_buffer_bytes(64 * 64 * 4) == 256 * 2**20
    assert vllm_engine.packed_buffer_bytes(152064 * 3584 * 2) == 152064 * 3584 * 2
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    given = {}
    monkeypatch.setattr(WeightTransferTrainerFactory, "trainer_init",
                        classmethod(lambda cls, info, **kw: given.setdefault(info.backend, info)))
    for backend in ("ipc", "nccl"):
        config = types.SimpleNamespace(weight_transfer_config=types.SimpleNamespace(backend=backend))
        llm = types.SimpleNamespace(llm_engine=types.SimpleNamespace(vllm_config=config))
        args = online_dpo_vllm.Args()
        args.world_size = 1
        weight_handoff.weight_transfer(args, llm, large, rank=0)
        assert given[backend].packed and given[backend].packed_buffer_size_bytes == 152064 * 3584 * 2, backend
    # One NCCL buffer each way: with vLLM 0.32's two, its receiver could reissue a block while layer-wise reload still
    # read the layer split across it on the other stream
    assert given["nccl"].packed_num_buffers == 1


@pytest.mark.parametrize("config_file", sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))),
                         ids=os.path.basename)
def test_every_deepspeed_config_is_valid_as_the_scripts_fill_it_in(config_file):
    with open(config_file) as f:
        given = json.load(f)
    zero = given["zero_optimization"]
    for bf16 in (True, False):
        args = online_dpo_vllm.Args(deepspeed_config=config_file, bf16=bf16, per_device_train_batch_size=16,
                           gradient_accumulation_steps=4)
        for train in (True, False):
            config = distributed.ds_config(args, train)
            parsed = DeepSpeedConfig(config)  # DeepSpeed's own parser and checks
            assert parsed.bfloat16_config.enabled is bf16
            assert parsed.train_micro_batch_size_per_gpu == 16
            assert parsed.gradient_accumulation_steps == (4 if train else 1)
            if train:
                assert parsed.zero_optimization_stage == zero["stage"]
                assert parsed.gradient_clipping == given["gradient_clipping"]  # 1.0, or none (TBA's, 0)
            else:  # frozen: partitioned like the policy under ZeRO-3, else replicated; never optimizer state
                assert parsed.zero_optimization_stage == (3 if zero["stage"] == 3 else 0)
                assert "offload_optimizer" not in config["zero_optimization"]
            # zero3_offload.json offloads the parameters of frozen models too, not only the policy's
            offloaded = parsed.zero_config.offload_param is not None and parsed.zero_config.offload_param.device == "cpu"
            assert offloaded == ("offload_param" in zero)


def test_weight_sync_is_memory_on_gpus_and_file_on_a_cpu_where_memory_needs_a_vllm_plugin(monkeypatch, capsys):
    """vLLM's weight transfer runs on GPUs (NCCL, CUDA IPC); on a CPU only with a plugin giving its "nccl" engine,
    such as tests/cpu_weight_transfer (on PYTHONPATH in the tests, see conftest.py). Without one, --weight-sync
    memory on a CPU is bad input."""
    check = vllm_engine.check_weight_sync
    for cuda, default in ((False, "file"), (True, "memory")):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        args = online_dpo_vllm.Args()
        check(args)
        assert args.weight_sync == default
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    check(online_dpo_vllm.Args(weight_sync="memory"))  # the tests' plugin is installed
    monkeypatch.setenv("PYTHONPATH", "")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "cpu_weight_transfer" not in p])
    with pytest.raises(SystemExit) as exit:
        check(online_dpo_vllm.Args(weight_sync="memory"))
    (line,) = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and line.startswith("error: --weight-sync: memory needs a GPU")


@pytest.mark.parametrize("version, supported", [("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True),
                                                ("0.26.0", False), ("0.34.0", False), ("0.3.2", False), (None, False)])
def test_the_vllm_scripts_stop_in_one_line_under_a_vllm_release_they_do_not_follow(capsys, version, supported):
    """vLLM 0.32 and 0.33 (their weight transfer differs: PolicyWeights follows both); 0.26-0.31 had other
    trainer-side engines, torch 2.11 users can only install up to 0.26. The installed one, read without importing
    vLLM, is 0.32 here."""
    assert vllm_engine.installed_vllm().startswith("0.32")
    if supported:
        vllm_engine.check_vllm_version(version)
        return
    with pytest.raises(SystemExit) as exit:
        vllm_engine.check_vllm_version(version)
    (line,) = capsys.readouterr().err.splitlines()
    assert exit.value.code == 2 and line.startswith("error: the *_vllm.py scripts need vLLM 0.32 or 0.33")
    assert (f"vLLM {version} is installed" if version else "no vLLM is installed") in line


def test_a_hub_id_this_machine_cannot_read_stops_in_one_line_within_seconds(capsys):
    """A model path that is no local directory, on a machine without the hub (this one: package registries only): one
    line naming the argument and how to run offline, not transformers' traceback after its retries (about 30 s)."""
    started = time.time()
    with pytest.raises(SystemExit) as exit:
        checks.check_model(types.SimpleNamespace(sft_model_path="some-org/no-such-model", trust_remote_code=False),
                           "sft_model_path")
    error = capsys.readouterr().err
    assert exit.value.code == 2 and error.count("\n") == 1 and time.time() - started < 15, error
    assert error.startswith("error: --sft-model-path: some-org/no-such-model is not a local directory, and the "), error


# The arguments a resumed run may change, by the kind of reason checkpoints.RESUME_MAY_CHANGE gives: written out here, not
# read from that list, so that a name added there (the temperature, say) fails the tests below until it is added here
# too, under a reason that says it does not change what is learned.
MAY_CHANGE_ON_RESUME = {
    "naming and logging": ["exp_name", "track", "wandb_project_name", "wandb_entity"],
    "paths (the checkpoint holds the state)": ["output_dir", "resume", "sft_model_path", "reward_model_path",
                                               "deepspeed_config"],
    "evaluation only": ["eval_every", "num_eval_prompts", "dataset_eval_split", "gold_reward_model_path"],
    "checkpoints and checks": ["save_every", "check_weights_every"],
    "launcher, permission, placement, memory, waiting, speed": [
        "local_rank", "trust_remote_code", "vllm_gpu", "vllm_cpu_cores", "vllm_gpu_memory_utilization",
        "gradient_checkpointing", "generation_timeout", "vllm_enforce_eager", "weight_sync"],
}
MAY_CHANGE = {name for names in MAY_CHANGE_ON_RESUME.values() for name in names}


@pytest.mark.parametrize("script", ALGORITHMS)
def test_a_resume_refuses_every_argument_that_decides_what_is_learned(script, tmp_path, capsys):
    """Every argument of a script's Args must be the checkpoint's when a run resumes, but those MAY_CHANGE_ON_RESUME
    lists (logging, evaluation, placement, paths): a resume that changes the temperature, TBA's buffer, GRPO's loss
    type or any other silently becomes another run."""
    module = importlib.import_module(script.removesuffix(".py"))
    args = module.Args()
    saved = dataclasses.asdict(args)
    (tmp_path / "trainer_state.json").write_text(json.dumps({"update": 2, "episode": 128, "args": saved}))
    args.resume = str(tmp_path)
    refused = []
    for name in saved:
        (tmp_path / "trainer_state.json").write_text(json.dumps(
            {"update": 2, "episode": 128, "args": {**saved, name: ["a value of another run"]}}))
        try:
            checkpoints.check_resume(args)
        except SystemExit as exit:
            assert exit.code == 2
            refused.append(name)
            assert f"--{name.replace('_', '-')}" in capsys.readouterr().err or name == "world_size"
    assert "temperature" in refused and "learning_rate" in refused and "seed" in refused
    assert sorted(refused) == sorted(set(saved) - MAY_CHANGE), set(saved) - MAY_CHANGE ^ set(refused)


def test_every_argument_a_resume_may_change_is_an_argument_with_a_reason():
    """checkpoints.RESUME_MAY_CHANGE names exactly the arguments listed above (a change to it is made in both places)."""
    assert sorted(checkpoints.RESUME_MAY_CHANGE) == sorted(MAY_CHANGE) and len(MAY_CHANGE) == 24
    arguments = {field for script in ALGORITHMS
                 for field in importlib.import_module(script.removesuffix(".py")).Args.__dataclass_fields__}
    assert set(checkpoints.RESUME_MAY_CHANGE) <= arguments, set(checkpoints.RESUME_MAY_CHANGE) - arguments
    assert all(len(reason) > 5 for reason in checkpoints.RESUME_MAY_CHANGE.values())


def test_vllms_reload_line_is_dropped_for_rotary_caches_alone():
    """A rotary embedding holds only a cache (vLLM's RotaryEmbedding; transformers' GPTNeoXRotaryEmbedding where vLLM
    runs the model through transformers): its 'Failed to load weights' line at every reload is noise. Any other
    layer's is a weight genuinely missing and must show."""
    import logging

    def shown(layer):
        record = logging.LogRecord("vllm", logging.WARNING, "layerwise.py", 266, "%s: Failed to load weights", (layer,), None)
        return vllm_engine.ReloadNoise().filter(record)

    assert not shown("RotaryEmbedding") and not shown("GPTNeoXRotaryEmbedding")
    assert shown("ParallelLMHead") and shown("VocabParallelEmbedding")
