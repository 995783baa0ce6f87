"""A real pretrained chat model, SmolLM2-135M-Instruct (assets/make_smollm2.py), where the tiny models cannot tell:
tied input and output embeddings, a pad token that is its EOS, a chat template with special tokens and a BOS.

- vLLM holds exactly the learner's weights after each hand-off (in memory, through files), and the run-time check
  names the parameter when it does not;
- an on-policy run keeps vLLM's and the learner's log-probabilities equal at every update;
- the tokenizer: the template's `<|im_end|>` is attended to, the vocabulary is the model's own, in checkpoints too;
- evaluate.py's vLLM reload of a tied model generates what the HF model generates."""

import glob
import json
import os
import shutil

import pytest
import torch
import vllm
from conftest import read_metrics, run_dir_of, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer
from vllm.inputs import TokensPrompt

import data
import rloo_vllm as script
import vllm_engine
import weight_handoff

pytestmark = pytest.mark.slow  # builds the model, runs vLLM engines and scripts: minutes

CHATS = [[{"role": "user", "content": "What is 3 + 5?"}], [{"role": "user", "content": "Add 7 and 2."}],
         [{"role": "system", "content": "Answer with a number."}, {"role": "user", "content": "What is 4 + 4?"}]]


def _prompts(tokenizer):
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) for chat in CHATS]


def _vllm_logprobs(llm, prompts, length):
    """vLLM's log-probabilities of the 5 likeliest tokens at each step of its greedy responses."""
    sampling = vllm.SamplingParams(temperature=0, max_tokens=length, logprobs=5)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return {(i, tuple(o.outputs[0].token_ids[:j]), token): logprob.logprob for i, o in enumerate(outputs)
            for j, step in enumerate(o.outputs[0].logprobs) for token, logprob in step.items()}


def _largest_difference(model, prompts, vllm_logprobs):
    difference, hf = 0.0, {}
    for (i, prefix, token), logprob in vllm_logprobs.items():
        if (i, prefix) not in hf:
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([prompts[i] + list(prefix)])).logits[0, -1]
            hf[i, prefix] = torch.log_softmax(logits.float(), -1)
        difference = max(difference, abs(hf[i, prefix][token].item() - logprob))
    return difference


def _move_far(model, seed):
    """A large step: the embedding (and with it the tied output layer) scaled, every weight perturbed."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(0.6)
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=generator) * 0.1 * p.std())


def _expected(model, probe, names):
    """The learner's WeightCheck of a plain HF model (what expected_weights takes from a DeepSpeed engine)."""
    engine = type("Engine", (), {"module": model, "__call__": lambda self, **kw: model(**kw)})()
    return weight_handoff.expected_weights(engine, probe, names, 49152, "cpu")


def test_tied_embeddings_reach_vllm_in_memory_and_through_files(smollm2, tmp_path, capfd):
    """A tied model, moved far, handed to vLLM in memory (tests/cpu_weight_transfer on this CPU) and then through a directory: vLLM's top-5
    log-probabilities equal the HF model's to 1e-4 (3.6 apart before the fix: vLLM kept the first output layer).
    The run-time check passes, and names the output layer when vLLM is given the model as transformers saves it.
    The output says only what is true: no "Failed to load" after a complete hand-off (vLLM's rotary cache is not a
    weight), vLLM's own line when a weight is genuinely missing."""
    path = os.path.join(smollm2, "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in _prompts(tokenizer)]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert weight_handoff.tied_output_names(model) == ["lm_head.weight"]
    weight_handoff.write_for_vllm(model, model.state_dict(), str(tmp_path / "v0"))
    tokenizer.save_pretrained(tmp_path / "v0")
    args = script.Args(bf16=False, response_length=8, max_prompt_length=56, batch_size=4, vllm_enforce_eager=True)
    args.world_size = 1
    llm = vllm_engine.start_vllm(args, str(tmp_path / "v0"), weight_transfer=True)
    try:
        assert _largest_difference(model, prompts, _vllm_logprobs(llm, prompts, 4)) < 1e-4
        start = _expected(model, prompts, None)
        digests = weight_handoff.vllm_digests(llm)
        names = sorted(n for n, d in start.digests.items() if digests.get(n) == d)
        assert {"model.embed_tokens.weight", "lm_head.weight"} <= set(names)  # on a CPU: embeddings and norms
        before = _vllm_logprobs(llm, prompts, 4)

        _move_far(model, 0)
        transfer = weight_handoff.weight_transfer(args, llm, model, rank=0)
        weight_handoff.send_weights(transfer, 1)
        transfer.finish()
        after = _vllm_logprobs(llm, prompts, 4)
        assert after != before and _largest_difference(model, prompts, after) < 1e-4
        weight_handoff.check_vllm_weights(llm, 1, prompts, _expected(model, prompts, names), bf16=False)

        _move_far(model, 1)
        weight_handoff.write_for_vllm(model, model.state_dict(), str(tmp_path / "v2"))
        capfd.readouterr()
        vllm_engine.load_into_vllm(llm, str(tmp_path / "v2"))
        assert "Failed to load" not in "".join(capfd.readouterr())
        assert _largest_difference(model, prompts, _vllm_logprobs(llm, prompts, 4)) < 1e-4
        weight_handoff.check_vllm_weights(llm, 2, prompts, _expected(model, prompts, names), bf16=False)

        # What vLLM 0.32 does with a tied model as save_pretrained writes it (the hand-off before the fix).
        _move_far(model, 2)
        model.save_pretrained(tmp_path / "v3")
        vllm_engine.load_into_vllm(llm, str(tmp_path / "v3"))
        assert "ParallelLMHead: Failed to load weights" in "".join(capfd.readouterr())
        assert _largest_difference(model, prompts, _vllm_logprobs(llm, prompts, 4)) > 0.1
        with pytest.raises(weight_handoff.WeightsDiffer, match=r"version 3 .* parameters that differ: lm_head\.weight"):
            weight_handoff.check_vllm_weights(llm, 3, prompts, _expected(model, prompts, names), bf16=False)
    finally:
        vllm_engine.shut_down(llm)


def test_pad_is_not_eos_and_the_chat_templates_end_of_turn_is_attended_to(smollm2):
    """The tokenizer pads with EOS (<|im_end|>), which chat prompts contain: a pad of its own is added to the
    tokenizer only, the model keeps its 49152 rows, and a left-padded batch gives each prompt the logits and the
    greedy tokens it has alone (the template's BOS once, at the start; its <|im_end|> read, not masked)."""
    path = os.path.join(smollm2, "model")
    original = AutoTokenizer.from_pretrained(path)
    assert original.pad_token_id == original.eos_token_id == original.convert_tokens_to_ids("<|im_end|>")
    tokenizer = data.load_tokenizer(path, False)
    pad = tokenizer.pad_token_id
    assert pad == len(original) == 49152 and pad != tokenizer.eos_token_id
    model = data.load_model(script.Args(bf16=False), path).eval()
    assert model.get_input_embeddings().num_embeddings == 49152 and model.lm_head.weight.shape[0] == 49152
    prompts = [tokenizer.encode(p, add_special_tokens=False) for p in _prompts(tokenizer)]
    for prompt in prompts:
        assert prompt.count(tokenizer.bos_token_id) == prompt.count(original.convert_tokens_to_ids("<|im_start|>"))
        assert prompt[0] == tokenizer.bos_token_id and tokenizer.eos_token_id in prompt
    queries = data.left_pad(prompts, pad, "cpu")
    assert (queries == pad).any()
    with torch.no_grad():
        batch = script.forward(model, queries, pad).logits[:, -1]
        alone = torch.stack([model(input_ids=torch.tensor([p])).logits[0, -1] for p in prompts])
        eos_masked = script.forward(model, queries.masked_fill(queries == tokenizer.eos_token_id, pad), pad).logits[:, -1]
    assert (batch - alone).abs().max() < 1e-4
    assert (eos_masked - alone).abs().max() > 1.0  # what masking the template's <|im_end|> as padding would do
    responses = script.generate(model, queries, pad, tokenizer.eos_token_id, 8)
    for prompt, response in zip(prompts, responses.tolist()):
        greedy = script.generate(model, torch.tensor([prompt]), pad, tokenizer.eos_token_id, 8)[0].tolist()
        assert response[:len(greedy)] == greedy


SMOLLM2_RUN = ["--dataset-name", "assets/smollm2/data", "--rule-reward", "last_number", "--max-prompt-length", "56",
               "--response-length", "8", "--k", "2", "--per-device-train-batch-size", "4", "--num-eval-prompts", "8",
               "--missing-eos-penalty", "0", "--learning-rate", "5e-5", "--no-bf16", "--vllm-enforce-eager"]


@pytest.fixture(scope="module")
def sync_run(smollm2, tmp_path_factory):
    """rloo_vllm.py --sync on the real model in float32, 3 updates, every hand-off (in memory) checked, checkpoints 2
    and 3."""
    out = tmp_path_factory.mktemp("smollm2_sync")
    run_script("rloo_vllm.py", "--sft-model-path", os.path.join(smollm2, "model"), *SMOLLM2_RUN, "--sync",
               "--total-episodes", "12", "--weight-sync", "memory", "--check-weights-every", "1", "--save-every", "2", "--output-dir", str(out),
               timeout=900)
    for state in glob.glob(os.path.join(run_dir_of(str(out)), "checkpoint-*", "training_state")):
        shutil.rmtree(state)  # DeepSpeed's state (2.2 GB a checkpoint): no test here resumes
    yield run_dir_of(str(out))
    shutil.rmtree(out)  # two checkpoints of 0.5 GB each: the disk CI runs on may have little to spare


def test_the_head_runs_on_the_response_alone_on_the_real_model(smollm2):
    """SmolLM2 (its head is the tied input embedding; a vocabulary of 49,152): response_logits computes the head on
    the response's positions and the one before (17 of the ~45 of a chat prompt and 16 sampled tokens), and the
    log-probabilities and entropy from them equal those of the head on every position and a full log-softmax."""
    path = os.path.join(smollm2, "model")
    tokenizer = data.load_tokenizer(path, False)
    pad, stop = tokenizer.pad_token_id, tokenizer.eos_token_id
    model = data.load_model(script.Args(bf16=False), path).eval()
    queries = data.left_pad([tokenizer.encode(p, add_special_tokens=False) for p in _prompts(tokenizer)], pad, "cpu")
    torch.manual_seed(0)
    responses = script.generate(model, queries, pad, stop, 16, temperature=0.7)
    responses = script.truncate_response(responses, stop, pad)
    query_responses, context_length = torch.cat([queries, responses], 1), queries.shape[1]
    head = []
    model.get_output_embeddings().register_forward_hook(lambda module, inputs, out: head.append(out.shape[1]))
    with torch.no_grad():
        ours = script.response_logits(model, query_responses, pad, context_length)
        full = script.forward(model, query_responses, pad).logits[:, context_length - 1: -1]
    assert head == [responses.shape[1] + 1, query_responses.shape[1]] and context_length > 2 * responses.shape[1]
    assert (ours - full).abs().max() < 1e-4
    mask = responses != pad
    full = full.double() / 0.7  # the exact values, against float32's rounding of either computation
    expected = torch.log_softmax(full, -1).gather(-1, responses.clamp(max=49151).unsqueeze(-1)).squeeze(-1)
    assert ((script.response_logprobs(ours, responses, 0.7) - expected) * mask).abs().max() < 1e-4
    entropy = -(torch.softmax(full, -1) * torch.log_softmax(full, -1)).sum(-1)
    # (float32's logsumexp minus the expectation: both about 30 here, so 1e-4 apart from the exact entropy as before)
    assert ((script.entropy_from_logits(ours / 0.7) - entropy) * mask).abs().max() < 3e-4


def test_an_on_policy_run_keeps_vllm_on_the_learners_policy(sync_run):
    """On-policy, vLLM samples from the learner's policy: the KL between its log-probabilities and the learner's
    stays under 1e-6 at every update (2.2e-5, 4.0e-5, 6.5e-5 with the output layer vLLM kept before the fix),
    while the policy moves."""
    rows = [row for row in read_metrics(sync_run) if "async/mismatch_kl" in row]
    assert len(rows) == 3
    assert all(row["async/mismatch_kl"] < 1e-6 for row in rows), [row["async/mismatch_kl"] for row in rows]
    assert rows[-1]["objective/kl"] > 1e-3


def test_checkpoints_of_the_real_model_keep_its_vocabulary_and_tokenizer(sync_run, smollm2):
    checkpoint = os.path.join(sync_run, "checkpoint-3")
    with open(os.path.join(checkpoint, "config.json")) as f:
        config = json.load(f)
    assert config["vocab_size"] == 49152 and config["tie_word_embeddings"] and config["pad_token_id"] == 2
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    original = AutoTokenizer.from_pretrained(os.path.join(smollm2, "model"))
    assert len(tokenizer) == 49152 and tokenizer.get_vocab() == original.get_vocab()
    assert tokenizer.pad_token == "<|im_end|>"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_evaluate_with_vllm_reloads_a_tied_model_as_hf_generates(sync_run, tmp_path):
    """evaluate.py's vLLM backend starts from the first checkpoint and reloads the others: each checkpoint's greedy
    accuracy and response lengths are those of HF generation from the same weights."""
    results = {}
    for backend in ("hf", "vllm"):
        run_script("evaluate.py", "--checkpoints", sync_run, "--sft-model-path", "assets/smollm2/model", "--dataset-name",
                   "assets/smollm2/data", "--rule-reward", "last_number", "--response-length", "8",
                   "--max-prompt-length", "56", "--num-eval-prompts", "16", "--temperature", "0", "--no-bf16", "--vllm-enforce-eager", "--backend", backend,
                   "--output", str(tmp_path / f"{backend}.json"), timeout=900)
        with open(tmp_path / f"{backend}.json") as f:
            results[backend] = json.load(f)["checkpoints"]
    assert len(results["hf"]) == 2  # checkpoint-2, then checkpoint-3 reloaded
    for checkpoint, metrics in results["hf"].items():
        for name in ("accuracy", "response_length"):
            assert results["vllm"][checkpoint][name] == pytest.approx(metrics[name], abs=1e-6), (checkpoint, name)
