"""LoRA (--lora-rank) in rloo.py: the policy is a peft model whose adapter alone trains; the reference is the same
model with the adapter off (no second copy); checkpoints hold the adapter in peft's format.

- the reference is the base model bit for bit, on the tiny model and on SmolLM2 (tied embeddings, a chat template);
- rloo.py learns with an adapter, starts from the reference exactly, and saves an adapter that peft loads;
- a run with an adapter resumes exactly from a checkpoint that holds the adapter alone."""

import glob
import os
import shutil

import pytest
import torch
from conftest import TINY, algorithm_metrics, read_metrics, run_dir_of, run_script
from transformers import AutoModelForCausalLM

import data
import rloo
from distributed import reference_model


def _engine(model):
    """What reference_model() takes of a DeepSpeed engine, for a plain (peft) model."""
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


def test_a_run_with_an_adapter_resumes_exactly(tmp_path):
    """The checkpoint keeps the adapter and its optimizer state, not the frozen base (DeepSpeed's
    exclude_frozen_parameters): a run resumed at update 2 repeats updates 3 and 4 to the bit."""
    common = ["rloo.py", "--lora-rank", "8", "--learning-rate", "3e-3", "--total-episodes", "256", "--eval-every", "2",
              "--save-every", "2", "--num-eval-prompts", "32"]
    run_script(*common, "--output-dir", str(tmp_path / "whole"))
    run_dir = run_dir_of(tmp_path / "whole")
    resumed = tmp_path / "resumed" / os.path.basename(run_dir)
    shutil.copytree(run_dir, resumed)
    shutil.rmtree(resumed / "checkpoint-4")
    state = torch.load(glob.glob(str(resumed / "checkpoint-2" / "training_state" / "policy" / "mp_rank_00_model_states.pt"))[0],
                       weights_only=False)["module"]
    assert state and all("lora_" in name for name in state)  # the adapter alone
    run_script(*common, "--output-dir", str(tmp_path / "resumed"), "--resume", str(resumed))
    expected, got = algorithm_metrics(read_metrics(run_dir)), algorithm_metrics(read_metrics(resumed))
    assert [row["update"] for row in got] == list(range(5)) and expected == got
