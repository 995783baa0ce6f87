"""Argument checks, several of them of failures only a GPU would show, run here on their logic: LoRA in vLLM needs
bfloat16 on a GPU, --vllm-gpu names a GPU of the node, a float32 engine computes Triton's dots in IEEE float32; LoRA
takes no dropout; a missing asset directory names what builds it."""

import importlib
import os
import sys
import types

import pytest
import torch
from conftest import TINY
from test_plumbing import FakeNvml, RecordedLLM

import checks
import online_dpo_vllm
import rloo_vllm
import vllm_engine


def one_line_error(capsys, call):
    with pytest.raises(SystemExit) as exit:
        call()
    error = capsys.readouterr().err
    assert exit.value.code == 2 and error.count("\n") == 1, error
    return error


@pytest.mark.parametrize("gpu", [True, False], ids=["gpu", "cpu"])
def test_lora_in_float32_is_refused_on_a_gpu_only(monkeypatch, capsys, gpu):
    """vLLM's Triton LoRA kernels take bfloat16 or float16 only and the adapter takes the model's dtype: on a GPU a
    float32 LoRA run stops before anything loads; on a CPU (torch ops) it runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu)
    args = rloo_vllm.Args(lora_rank=8, bf16=False)
    if gpu:
        error = one_line_error(capsys, lambda: vllm_engine.check_vllm_lora(args))
        assert error.startswith("error: --bf16: vLLM serves a LoRA adapter on a GPU in bfloat16 or float16 only"), error
    else:
        vllm_engine.check_vllm_lora(args)
    vllm_engine.check_vllm_lora(rloo_vllm.Args(lora_rank=8, bf16=True))  # bfloat16 on either
    vllm_engine.check_vllm_lora(rloo_vllm.Args(lora_rank=0, bf16=False))  # full fine-tuning: any precision


@pytest.mark.parametrize("vllm_gpu, gpus, error", [(8, 8, "this node has 8 GPU(s), indices 0 to 7, got 8"),
                                                   (1, 4, "GPU 1 is training rank 1's: vLLM may share rank 0's only"), (7, 8, None), (0, 1, None)])
def test_vllm_gpu_is_a_gpu_of_the_node_checked_before_anything_loads(monkeypatch, capsys, vllm_gpu, gpus, error):
    """--vllm-gpu past the node's GPUs (NVML counts them, also those a launcher hid) or another training rank's stops
    in validate, not in vLLM's start after every model loaded."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(gpus))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    args = types.SimpleNamespace(vllm_gpu=vllm_gpu)
    if error is None:
        vllm_engine.check_vllm_gpu(args)
    else:
        assert one_line_error(capsys, lambda: vllm_engine.check_vllm_gpu(args)) == f"error: --vllm-gpu: {error}\n"


@pytest.mark.parametrize("bf16, user, expected", [(False, None, "ieee"), (False, "tf32", "tf32"), (True, None, None)])
def test_a_float32_engine_on_a_gpu_computes_tritons_dots_in_ieee_float32(monkeypatch, bf16, user, expected):
    """vLLM's Triton attention (compute capability 9) runs float32 dots in TF32 unless TRITON_F32_DEFAULT says
    otherwise, while the learner's float32 is IEEE: a float32 engine starts with it set to ieee (the user's value
    wins); a bfloat16 one is left as it is. Set only in the engine's environment (start_vllm's GPU branch recorded)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (80 * 2**30, 80 * 2**30))
    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml(2))
    monkeypatch.setattr(importlib.import_module("vllm"), "LLM", RecordedLLM)
    monkeypatch.setattr(vllm_engine, "reap_when_the_learner_dies", lambda llm: None)
    for name in ("CUDA_VISIBLE_DEVICES", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "TRITON_F32_DEFAULT"):
        monkeypatch.delenv(name, raising=False)
    if user is not None:
        monkeypatch.setenv("TRITON_F32_DEFAULT", user)
    args = online_dpo_vllm.Args(bf16=bf16)
    args.world_size = 1
    llm = vllm_engine.start_vllm(args, os.path.join(TINY, "sft"))
    assert llm.engine_args["dtype"] == ("bfloat16" if bf16 else "float32")
    assert llm.environ.get("TRITON_F32_DEFAULT") == expected
    assert os.environ.get("TRITON_F32_DEFAULT") == user  # the learner's own environment is left as it was


@pytest.mark.parametrize("dropout, refused", [(0.0, False), (0.1, True), (1e-6, True)])
def test_lora_takes_no_dropout_as_sampling_has_none(capsys, dropout, refused):
    """HF and vLLM sample without dropout: with it in the learner's passes alone a policy's ratio to itself is not 1."""
    args = rloo_vllm.Args(lora_rank=8, lora_dropout=dropout)
    if refused:
        error = one_line_error(capsys, lambda: checks.check_lora(args))
        assert error.startswith(f"error: --lora-dropout: must be 0, got {dropout}: responses are sampled without"), error
    else:
        checks.check_lora(args)


@pytest.mark.parametrize("argument, path, hint", [
    ("sft_model_path", "assets/smollm2/no-such-model", " (build it with `python assets/make_smollm2.py`)"),
    ("sft_model_path", "assets/tiny_math/no-such-sft", " (build it with `python assets/make_tiny_math.py`)"),
    ("sft_model_path", "no-such-dir/model/x", "")])
def test_a_missing_asset_directory_names_what_builds_it(capsys, argument, path, hint):
    """The SmolLM2 model is built by assets/make_smollm2.py, not shipped: a fresh clone's first SmolLM2 command says
    so in its one line (it was transformers' 40-line HFValidationError)."""
    error = one_line_error(capsys, lambda: checks.check_model_path(argument, path))
    assert error == f"error: --sft-model-path: no such directory: {path}{hint}\n", error
    args = types.SimpleNamespace(dataset_name=path.replace("sft", "data").replace("model", "data"))
    error = one_line_error(capsys, lambda: checks.check_dataset_path(args))
    assert error == f"error: --dataset-name: no such directory: {args.dataset_name}{hint}\n", error
