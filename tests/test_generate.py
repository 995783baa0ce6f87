"""The scripts' decoding loop (`generate`, shared by every script) gives HF `generate`'s tokens."""

import json
import os

import pytest
import torch
from conftest import TINY
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

import rloo


def tiny_policy():
    """The tiny task's SFT policy (GPT-NeoX) on 8 real prompts of different lengths; it stops at EOS."""
    tokenizer = rloo.load_tokenizer(os.path.join(TINY, "sft"), trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft")).eval()
    with open(os.path.join(TINY, "data", "test.jsonl")) as f:
        prompts = [json.loads(line)["query"] for line in f][:8]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"][-10 - i:] for i, p in enumerate(prompts)]
    return model, rloo.left_pad(ids, tokenizer.pad_token_id, "cpu"), tokenizer.pad_token_id, tokenizer.eos_token_id


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
