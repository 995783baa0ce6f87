"""LoRA (--lora-rank): the policy is a peft model whose adapter alone trains; the reference is the same model with the
adapter off (no second copy); checkpoints hold the adapter in peft's format; the *_vllm.py scripts hand vLLM only the
adapter, one version per update, and the weight check covers it.

- the reference is the base model bit for bit, on the tiny model and on SmolLM2 (tied embeddings, a chat template);
- rloo.py learns with an adapter, starts from the reference exactly, and saves an adapter that peft loads;
- a run with an adapter resumes exactly from a checkpoint that holds the adapter alone;
- vLLM generates with each adapter version as peft computes it (the tiny model and SmolLM2), and the weight check
  stops a stale adapter (verl's and ms-swift's bug) and a missing one;
- rloo_vllm.py learns asynchronously with an adapter, its run's weight checks hold, a resumed run repeats it exactly,
  and an adapter version that never reaches vLLM stops the run at its check;
- every other algorithm script trains an adapter alone from the reference (PPO's value model too, with its head), and
  its *_vllm.py sibling hands vLLM the adapter, checked at every update;
- two processes under ZeRO-3 train and hand off an adapter (gathered alone, never the frozen base);
- evaluate.py evaluates an adapter checkpoint, merged into the SFT model, with HF and with vLLM."""

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch
from conftest import ROOT, SHIPPED, TINY, algorithm_metrics, read_metrics, run_dir_of, run_patched, run_script
from test_real_model import CHATS, _largest_difference, _vllm_logprobs
from transformers import AutoModelForCausalLM

import data
import rloo
import rloo_vllm
import vllm_engine
import weight_handoff
from distributed import reference_model

pytestmark = pytest.mark.slow  # vLLM engines and script runs: minutes


def _engine(model):
    """What reference_model() and the weight check take of a DeepSpeed engine, for a plain (peft) model."""
    return type("Engine", (), {"module": model, "__call__": lambda self, **kw: model(**kw)})()


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_the_reference_is_the_policy_with_its_adapter_off_bit_for_bit(which, request):
    path = os.path.join(TINY, "sft") if which == "tiny" else os.path.join(request.getfixturevalue("smollm2"), "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11]])
    with torch.no_grad():
        base = model(input_ids=ids).logits
    args = rloo.Args(lora_rank=8)
    policy = _engine(data.with_lora(args, model))
    trained = {name for name, p in policy.module.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in name for name in trained)  # only the adapter trains
    with torch.no_grad():
        for name, p in policy.module.named_parameters():
            if "lora_B" in name:  # a fresh adapter is the identity (B = 0): move it
                p.normal_(0, 0.05)
        with reference_model(policy, None) as reference:
            assert torch.equal(reference(input_ids=ids).logits, base)
        assert (policy(input_ids=ids).logits - base).abs().max() > 1e-3  # the adapter is back on


def test_rloo_learns_with_an_adapter_and_saves_it_in_peft_format(tmp_path):
    """rloo.py --lora-rank 8 on the tiny task (a LoRA learning rate, 3e-3): the held-out scores rise; the first
    update's KL is exactly 0 (a fresh adapter is the identity); the checkpoint is a peft adapter without the full
    weights, which peft loads onto the SFT model."""
    run_script("rloo.py", "--lora-rank", "8", "--learning-rate", "3e-3", "--total-episodes", "640", "--eval-every",
               "5", "--output-dir", str(tmp_path))
    rows = read_metrics(run_dir_of(tmp_path))
    scores = [(row["eval/scores"], row["eval/gold_scores"]) for row in rows if "eval/scores" in row]
    assert scores[-1][0] - scores[0][0] > 2.0 and scores[-1][1] - scores[0][1] > 0.4, scores
    assert rows[1]["objective/kl"] == 0.0
    checkpoint = os.path.join(run_dir_of(tmp_path), "checkpoint-10")
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(os.listdir(checkpoint))
    assert not glob.glob(os.path.join(checkpoint, "model*.safetensors"))
    from peft import PeftModel

    sft = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft")), checkpoint)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert (trained(input_ids=ids).logits - sft(input_ids=ids).logits).abs().max() > 1e-3
        merged = trained.merge_and_unload()  # what evaluate.py evaluates
        assert (merged(input_ids=ids).logits - trained(input_ids=ids).logits).abs().max() < 1e-5

    # evaluate.py on the adapter checkpoint (merged into the SFT model), with HF and with vLLM, against the SFT model.
    evaluations = {}
    for name, checkpoints, backend in (("sft", os.path.join(TINY, "sft"), "hf"), ("hf", checkpoint, "hf"),
                                       ("vllm", checkpoint, "vllm")):
        run_script("evaluate.py", "--checkpoints", checkpoints, "--backend", backend, "--num-eval-prompts", "64",
                   "--vllm-enforce-eager", "--output", str(tmp_path / f"{name}.json"))
        with open(tmp_path / f"{name}.json") as f:
            (evaluations[name],) = json.load(f)["checkpoints"].values()
    assert evaluations["hf"]["gold_score"] > evaluations["sft"]["gold_score"] + 0.5
    assert evaluations["hf"]["kl"] > 0.1 and evaluations["vllm"]["kl"] > 0.1
    assert evaluations["vllm"]["gold_score"] == pytest.approx(evaluations["hf"]["gold_score"], abs=0.05)


def _move_adapter(model, seed):
    """A large step of the adapter alone (a fresh one is the identity: its B is zero)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.add_(torch.randn(p.shape, generator=generator) * 0.05)


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_vllm_generates_with_each_adapter_version_as_peft_does_and_the_check_stops_a_stale_one(which, request,
                                                                                                 tmp_path):
    path = os.path.join(TINY, "sft") if which == "tiny" else os.path.join(request.getfixturevalue("smollm2"), "model")
    tokenizer = data.load_tokenizer(path, False)  # its pad token is no EOS, as in the scripts
    texts = ([tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]
             if tokenizer.chat_template else ["SUBREDDIT: r/tech\nPOST: my phone", "TL;DR: a new router"])
    prompts = [tokenizer.encode(text, add_special_tokens=False) for text in texts]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        base_logits = [model(input_ids=torch.tensor([p])).logits for p in prompts]
    args = rloo_vllm.Args(bf16=False, response_length=8, max_prompt_length=56, batch_size=4, vllm_enforce_eager=True,
                          lora_rank=8)
    args.world_size = 1
    policy = _engine(data.with_lora(args, model))
    _move_adapter(policy.module, 0)

    # The reference: the policy with its adapter off is the base model, bit for bit.
    with torch.no_grad(), reference_model(policy, None) as reference:
        assert all(torch.equal(reference(input_ids=torch.tensor([p])).logits, logits)
                   for p, logits in zip(prompts, base_logits))
    with torch.no_grad():  # the adapter is back on
        assert not torch.equal(policy(input_ids=torch.tensor([prompts[0]])).logits, base_logits[0])

    policy.module.save_pretrained(tmp_path / "policy-0")
    llm = vllm_engine.start_vllm(args, path, lora_rank=8)
    try:
        adapter = vllm_engine.add_adapter(llm, 0, str(tmp_path / "policy-0"))
        expected = weight_handoff.expected_weights(policy, prompts, None, tokenizer.pad_token_id, "cpu")
        names = weight_handoff.digests_to_check(expected.digests, weight_handoff.vllm_digests(llm, adapter), False)
        assert sum("lora_" in name for name in names) == 2 * len([n for n in expected.digests if "lora_A" in n]) > 0
        for version in (0, 1, 2):
            if version:  # an update, then its hand-off: the new adapter in, the old one out
                _move_adapter(policy.module, version)
                policy.module.save_pretrained(tmp_path / f"policy-{version}")
                adapter = vllm_engine.swap_adapter(llm, adapter, version, str(tmp_path / f"policy-{version}"))
                assert set(llm.llm_engine.list_loras()) == {version + 1} and not (tmp_path / f"policy-{version - 1}").exists()
            with torch.no_grad():
                difference = _largest_difference(policy.module, prompts, _vllm_logprobs_with(llm, prompts, adapter))
            # float32: at SmolLM2's version 2 1.05e-4 seen alone, 2.5e-4 beside another test process (a wrong or
            # missing adapter differs by far more: the stale cases below)
            assert difference < 5e-4, (version, difference)
            weight_handoff.check_vllm_weights(llm, version, prompts, weight_handoff.expected_weights(
                policy, prompts, names, tokenizer.pad_token_id, "cpu"), bf16=False, adapter=adapter)

        # verl's bug: version 3 never reaches vLLM, which goes on with version 2's adapter.
        _move_adapter(policy.module, 3)
        expected = weight_handoff.expected_weights(policy, prompts, names, tokenizer.pad_token_id, "cpu")
        with pytest.raises(weight_handoff.WeightsDiffer, match=r"version 3 .*it generates with policy-2's"):
            weight_handoff.check_vllm_weights(llm, 3, prompts, expected, bf16=False, adapter=adapter)
        # ... and when the request names version 3, the adapter vLLM was given is not the learner's.
        stale = vllm_engine.add_adapter(llm, 3, str(tmp_path / "policy-2"))
        with pytest.raises(weight_handoff.WeightsDiffer, match=r"version 3 .* parameters that differ: "
                                                               r"base_model\.model\..*lora_"):
            weight_handoff.check_vllm_weights(llm, 3, prompts, expected, bf16=False, adapter=stale)
        # An adapter vLLM does not hold (never attached, or dropped).
        llm.llm_engine.remove_lora(stale.lora_int_id)
        with pytest.raises(weight_handoff.WeightsDiffer, match=r"does not hold the LoRA adapter of version 3"):
            weight_handoff.check_vllm_weights(llm, 3, prompts, expected, bf16=False, adapter=stale)
    finally:
        vllm_engine.shut_down(llm)


def _vllm_logprobs_with(llm, prompts, adapter):
    """_vllm_logprobs under a LoRA adapter."""
    generate = llm.generate
    llm.generate = lambda *a, **kw: generate(*a, lora_request=adapter, **kw)
    try:
        return _vllm_logprobs(llm, prompts, 4)
    finally:
        del llm.generate


VLLM_LORA = ["rloo_vllm.py", "--lora-rank", "8", "--learning-rate", "3e-3", "--vllm-enforce-eager",
             "--check-weights-every", "2", "--eval-every", "2", "--save-every", "2", "--num-eval-prompts", "64"]


def test_rloo_vllm_learns_with_an_adapter_and_resumes_exactly(tmp_path):
    """Asynchronous (one update late), only the adapter handed to vLLM, checked every 2 updates: it learns, and a run
    resumed from its checkpoint at update 2 (with the batches generated ahead) repeats the rest to the bit. The
    checkpoint keeps the adapter and its optimizer state, not the frozen base (DeepSpeed's exclude_frozen_parameters;
    checkpoints.py serves every script)."""
    whole = run_script(*VLLM_LORA, "--total-episodes", "384", "--output-dir", str(tmp_path / "whole"))
    assert "its LoRA adapter" in whole.stdout and whole.stdout.count("weight check:") == 1
    run_dir = run_dir_of(tmp_path / "whole")
    rows = read_metrics(run_dir)
    assert [row["async/off_policy_steps"] for row in rows[1:]] == [0, 1, 1, 1, 1, 1]
    scores = [row["eval/scores"] for row in rows if "eval/scores" in row]
    assert scores[-1] - scores[0] > 1.0, scores

    resumed_dir = tmp_path / "resumed" / os.path.basename(run_dir)
    shutil.copytree(run_dir, resumed_dir)
    for later in ("checkpoint-4", "checkpoint-6"):
        shutil.rmtree(resumed_dir / later)
    (states,) = glob.glob(str(resumed_dir / "checkpoint-2" / "training_state" / "policy" / "mp_rank_00_model_states.pt"))
    state = torch.load(states, weights_only=False)["module"]
    assert state and all("lora_" in name for name in state)  # the adapter alone
    run_script(*VLLM_LORA, "--total-episodes", "384", "--output-dir", str(tmp_path / "resumed"),
               "--resume", str(resumed_dir))
    expected, got = algorithm_metrics(rows), algorithm_metrics(read_metrics(resumed_dir))
    assert [row["update"] for row in got] == list(range(7))
    for a, b in zip(expected, got):
        assert a.keys() == b.keys()
        for key in a:
            assert b[key] == pytest.approx(a[key], rel=1e-5, abs=1e-6), (a["update"], key)


# verl's and ms-swift's bug with LoRA: an adapter version never reaches vLLM, which goes on generating with the one
# before. The run itself, with its generator's swap to version 2's adapter skipped.
SKIPPED_ADAPTER = """
import runpy, sys
import generator
swap = generator.swap_adapter
generator.swap_adapter = lambda llm, adapter, version, path: adapter if version == 2 else swap(llm, adapter, version, path)
sys.argv = ["rloo_vllm.py", *sys.argv[1:]]
runpy.run_path("rloo_vllm.py", run_name="__main__")
"""


def test_an_adapter_that_never_reaches_vllm_stops_the_run_at_its_check(tmp_path):
    result, errors = run_patched(SKIPPED_ADAPTER, *VLLM_LORA[1:], "--total-episodes", "512", "--eval-every", "0",
                                 "--save-every", "0", "--output-dir", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith("error: vLLM does not hold the LoRA adapter of version 2 of the "
                                                     "learner's policy: it generates with policy-1's"), errors
    assert len(read_metrics(run_dir_of(tmp_path))) < 8


# (Of the *_vllm.py, ppo_vllm.py: its value model has an adapter and a head of its own. The other *_vllm.py have
# their HF sibling's LoRA lines, test_drift.py M8, and rloo_vllm.py runs above.)
OTHERS = [script for script in SHIPPED if script.endswith(".py") and not script.startswith(("evaluate", "rloo"))
          and (not script.endswith("_vllm.py") or script == "ppo_vllm.py")]


@pytest.mark.parametrize("script", OTHERS)
def test_every_script_trains_an_adapter_alone_from_the_reference(tmp_path, script):
    """Two updates at rank 8: the first update's KL is exactly 0 (a fresh adapter is the identity and the reference is
    the base); the checkpoint and DeepSpeed's state hold the adapter alone (and PPO's value model its adapter and
    score head), trained; a *_vllm.py (--sync: batch 2 is the trained adapter's) hands vLLM the adapter, its weight
    check holds at the hand-off, and vLLM's log-probabilities of batch 2 are the learner's under that adapter."""
    vllm = script.endswith("_vllm.py")
    result = run_script(script, "--lora-rank", "8", "--learning-rate", "3e-3", "--total-episodes", "128",
                        "--save-every", "2", "--eval-every", "0", "--num-eval-prompts", "32", "--output-dir", str(tmp_path),
                        *(["--vllm-enforce-eager", "--check-weights-every", "1", "--sync"] if vllm else []))
    rows = read_metrics(run_dir_of(tmp_path))
    assert [row["update"] for row in rows] == [0, 1, 2]
    # 0 but for float rounding where the KL is taken in training (TBA): the training micro-batch is not the scoring
    # pass's, and the head's matmul, on the response's positions alone, may round by the batch's size
    assert abs(rows[1].get("objective/kl", rows[1].get("pairs/kl"))) < 1e-6
    assert rows[2].get("objective/kl", rows[2].get("pairs/kl")) != 0.0
    if vllm:
        assert "its LoRA adapter" in result.stdout and rows[1]["async/mismatch_kl"] < 1e-6
        assert rows[2]["async/off_policy_steps"] == 0 and rows[2]["async/mismatch_kl"] < 1e-4, rows[2]
    checkpoint = os.path.join(run_dir_of(tmp_path), "checkpoint-2")
    from safetensors.torch import load_file

    for model in ("", "value_model") if script.startswith("ppo") else ("",):
        adapter = load_file(os.path.join(checkpoint, model, "adapter_model.safetensors"))
        assert not glob.glob(os.path.join(checkpoint, model, "model*.safetensors"))
        heads = {name for name in adapter if "lora_" not in name}
        assert heads == ({"base_model.model.score.weight"} if model else set())
        assert max(t.abs().max().item() for name, t in adapter.items() if "lora_B" in name) > 0  # trained (B starts 0)
        state = torch.load(os.path.join(checkpoint, "training_state", model or "policy", "mp_rank_00_model_states.pt"),
                           weights_only=False)["module"]
        assert state and all("lora_" in name or ".score." in name for name in state)


def test_two_processes_under_zero3_train_and_hand_off_an_adapter(tmp_path):
    """rloo_vllm.py, two ranks under ZeRO-3, two updates late: rank 0 gathers the adapter alone (the base stays
    partitioned) for vLLM at each hand-off, where the weight check finds it (batch 4 is version 1's); each rank saves
    its shard of the adapter and its optimizer state, rank 0 the whole adapter in peft's format."""
    from test_scripts_run import free_port, launch_two_processes

    launch_two_processes(tmp_path, free_port(), [
        "rloo_vllm.py", "--lora-rank", "8", "--learning-rate", "3e-3", "--off-policy-steps", "2", "--vllm-enforce-eager",
        "--check-weights-every", "1", "--deepspeed-config", "ds_configs/zero3.json", "--per-device-train-batch-size",
        "32", "--total-episodes", "256", "--save-every", "3", "--num-eval-prompts", "32", "--output-dir",
        str(tmp_path / "run")], nodes=1)
    rows = read_metrics(run_dir_of(tmp_path / "run"))
    # batch 4 is adapter version 1's, handed over and checked (--check-weights-every 1) after update 1
    assert [row["async/off_policy_steps"] for row in rows[1:]] == [0, 1, 2, 2]
    assert rows[1]["objective/kl"] == 0.0 and rows[1]["async/mismatch_kl"] < 1e-6
    checkpoint = os.path.join(run_dir_of(tmp_path / "run"), "checkpoint-3")
    from peft import PeftModel

    sft = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    trained = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft")), checkpoint)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        assert (trained(input_ids=ids).logits - sft(input_ids=ids).logits).abs().max() > 1e-3
    shards = glob.glob(os.path.join(checkpoint, "training_state", "policy", "zero_pp_rank_*_model_states.pt"))
    assert len(shards) == 2


def test_the_readmes_lora_command_learns_through_its_first_30_updates(tmp_path):
    """The README's LoRA command (rloo_vllm.py --lora-rank 8 --learning-rate 1e-3, 1,000 updates) at its own
    learning-rate schedule, its first 30 updates: where 3e-3 collapsed (every response the stop token alone from
    update 19, gold 0.02; benchmark/results/readme_lora_tiny.txt), the held-out gold score stays above the SFT
    policy's and no sign of a collapse is logged."""
    stderr = open(tmp_path / "stderr.txt", "w")
    process = subprocess.Popen([sys.executable, "rloo_vllm.py", "--lora-rank", "8", "--learning-rate", "1e-3",
                                "--eval-every", "10", "--vllm-enforce-eager", "--output-dir", str(tmp_path / "run")],
                               cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"}, stdout=subprocess.DEVNULL,
                               stderr=stderr)
    try:
        deadline = time.time() + 900
        while True:
            logged = glob.glob(str(tmp_path / "run" / "*__*" / "metrics.jsonl"))
            rows = read_metrics(os.path.dirname(logged[0])) if logged else []
            if any(row["update"] == 30 and "eval/gold_scores" in row for row in rows):
                break
            assert process.poll() is None and time.time() < deadline, open(tmp_path / "stderr.txt").read()[-3000:]
            time.sleep(1)
    finally:
        process.kill()
        process.wait()
        stderr.close()
    gold = {row["update"]: row["eval/gold_scores"] for row in rows if "eval/gold_scores" in row}
    assert all(gold[u] > gold[0] for u in (10, 20, 30)) and gold[30] > gold[0] + 0.5, gold
    assert "warning: update" not in open(tmp_path / "stderr.txt").read()
