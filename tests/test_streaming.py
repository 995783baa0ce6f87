"""--generation streaming: each token's policy version, as vLLM reports it, is the version that sampled it (its
log-probability is the learner's under that version), across hand-offs loaded while responses are in flight."""

import os

import pytest
import torch
from conftest import TINY, read_metrics, run_dir_of, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

import generator
import rloo_vllm
import vllm_engine
import weight_handoff

pytestmark = pytest.mark.slow  # vLLM engines

PROMPTS = ["The cat sat on the", "A dog ran to the", "Two and two make", "The sea is very"]


def _versions(model_path, tmp_path, count):
    """The policy and `count` later versions of it (each a save_pretrained directory vLLM loads, and the model), each
    moved far enough from the one before that a token's log-probability tells which sampled it."""
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    versions = [(model_path, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval())]
    generator_ = torch.Generator().manual_seed(0)
    for version in range(1, count + 1):
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn(parameter.shape, generator=generator_) * 0.02 * parameter.std())
        path = str(tmp_path / f"policy-{version}")
        weight_handoff.write_for_vllm(model, model.state_dict(), path)
        copy = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
        copy.load_state_dict(model.state_dict())
        versions.append((path, copy))
    return versions


def _learner_logprobs(model, prompt, tokens):
    """The learner's log-probability of each response token (temperature 1), in float64 from float32 logits."""
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1: -1].double()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]


@pytest.mark.parametrize("model, reported", [("tiny", "as loaded"), ("tiny", "the old version"),
                                             ("smollm2", "as loaded")])
def test_each_tokens_log_probability_is_that_of_the_version_vllm_reports_for_it(tmp_path, request, model, reported):
    """Four prompts x 2 responses of 24 tokens, two versions loaded mid-flight (after 4 and 10 decoding steps) by the
    streaming generator's own load: every response holds tokens of 3 versions, and each token's vLLM log-probability
    equals the learner's under the version vLLM reports for it (within the weight check's tolerance; 0.02 for one
    token). The attribution broken (the second version loaded but reported as the first) must fail that comparison."""
    path = os.path.join(TINY, "sft") if model == "tiny" else os.path.join(request.getfixturevalue("smollm2"), "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    versions = _versions(path, tmp_path, 2)
    args = rloo_vllm.Args(bf16=False, response_length=24, batch_size=8, temperature=1.0, vllm_enforce_eager=True,
                          max_prompt_length=32, seed=1)
    args.world_size = 1
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    llm = vllm_engine.start_vllm(args, path)
    try:
        thread = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                           rloo_vllm.batch_prompts, weights_dir=str(tmp_path), train_prompts=prompts,
                                           prompts_per_rank=4, k=2, stop_id=-1 % len(tokenizer), first_version=0,
                                           off_policy_steps=2, probe=None, in_memory=False)
        llm.llm_engine.set_weight_version("0")
        for _ in range(4):
            thread._submit()
        for step in range(1, 200):
            if step in (4, 10):
                version = 1 if step == 4 else 2
                if reported == "the old version" and version == 2:
                    llm.llm_engine.set_weight_version = lambda _: None  # loads version 2, still says 1
                thread._load(version, versions[version][0], None, None)
            thread._step(2 if step >= 10 else 1 if step >= 4 else 0)
            if not thread.running:
                break
    finally:
        vllm_engine.shut_down(llm)
    differences = []
    for group in thread.done:
        prompt = prompts[thread.untrained[group]]
        for tokens, logprobs, token_versions in thread.samples[group]:
            assert sorted(set(token_versions)) == ([0, 1, 2] if reported == "as loaded" else [0, 1])
            by_version = {v: _learner_logprobs(versions[v][1], prompt, tokens) for v in range(3)}
            learner = torch.stack([by_version[v][i] for i, v in enumerate(token_versions)])
            differences.append((torch.tensor(logprobs, dtype=torch.float64) - learner).abs())
    assert len(thread.done) == 4
    differences = torch.cat(differences)
    if reported == "as loaded":
        assert differences.mean() <= weight_handoff.PROBE_TOLERANCE[False] and differences.max() <= 0.02, differences
    else:
        assert differences.max() > 0.02 and differences.mean() > weight_handoff.PROBE_TOLERANCE[False]


def test_a_resumed_stream_trains_every_prompt_it_drew_once(tmp_path):
    """The streaming generator stopped after two batches of 4 prompts (its requests in flight dropped, as a killed run's
    are) and a second one resumed from its state() for four more: every prompt drawn from the script's order is trained
    on once, or is still drawn and untrained at the end, on its way to a batch; none is lost, none trained twice. A
    generator stopped in the middle of a batch of the order goes on from the next prompt."""
    args = rloo_vllm.Args(bf16=False, response_length=8, batch_size=8, vllm_enforce_eager=True, max_prompt_length=8,
                          seed=2, generation_timeout=120)
    args.world_size, args.num_updates, args.resume = 1, 6, None
    prompts = [[5, 6 + i, 7] for i in range(12)]  # 12 prompts: batches of 4 go through them in shuffled epochs
    common = dict(weights_dir=str(tmp_path), train_prompts=prompts, prompts_per_rank=4, k=2, stop_id=3, probe=None,
                  in_memory=False, off_policy_steps=10)  # (K = 10: no batch waits for a version)
    llm = vllm_engine.start_vllm(args, os.path.join(TINY, "sft"))
    trained = []
    try:
        first = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                          rloo_vllm.batch_prompts, first_version=0, **common)
        first.start()
        trained += [i for _ in range(2) for i in first.get().prompts[0]]
        first.stopping.set()
        first.thread.join(timeout=30)
        state = first.state()
        llm.llm_engine.abort_request([f"{g}/{j}" for g in first.running for j in range(2)])
        assert state["untrained"], state  # it had drawn more prompts than it trained on
        args.resume = "a checkpoint"
        second = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                           rloo_vllm.batch_prompts, first_version=2, resumed_stream=state, **common)
        second.start()
        trained += [i for _ in range(4) for i in second.get().prompts[0]]
        second.stopping.set()
        second.thread.join(timeout=30)
        end = second.state()
        # Every prompt drawn and not trained on is on its way: to be generated, in flight, finished or in a batch.
        queued = {group for batch in second.batches.queue for group in batch.stream["groups"]}
        assert set(second.untrained) == set(second.again) | set(second.running) | set(second.done) | queued
        llm.llm_engine.abort_request([f"{g}/{j}" for g in second.running for j in range(2)])
        # Stopped in the middle of a batch of the order (5 prompts drawn), a resumed generator draws the 6th next.
        third = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                          rloo_vllm.batch_prompts, first_version=0, **common)
        for _ in range(5):
            third._submit()
        llm.llm_engine.abort_request([f"{g}/{j}" for g in third.running for j in range(2)])
        fourth = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                           rloo_vllm.batch_prompts, first_version=0, resumed_stream=third.state(),
                                           **common)
        for _ in range(6):
            fourth._submit()
        llm.llm_engine.abort_request([f"{g}/{j}" for g in fourth.running for j in range(2)])
    finally:
        vllm_engine.shut_down(llm)
    order = [i for batch in range(1, end["next_batch"] + 1)
             for i in rloo_vllm.batch_prompts(args, len(prompts), 4, batch)[0]]
    drawn = order[:(end["next_batch"] - 1) * 4 + end["next_in_batch"]]
    assert len(trained) == 24 and sorted(trained + end["untrained"]) == sorted(drawn)
    assert [fourth.untrained[g] for g in fourth.running] == order[:5] + [order[5]]  # the 5 again, then the next


def test_tba_streams_its_prefill_and_its_batches_and_logs_their_versions(tmp_path):
    """tba_vllm.py, the script whose generator runs furthest ahead (--buffer-prefill: batches before update 1), in
    streaming mode with the weights in memory: three updates, each batch's tokens at most K = 1 versions behind, the
    first one's all the SFT policy's."""
    run_script("tba_vllm.py", "--generation", "streaming", "--weight-sync", "memory", "--buffer-prefill", "64",
               "--total-episodes", "192", "--eval-every", "0", "--vllm-enforce-eager", "--output-dir", str(tmp_path))
    rows = read_metrics(run_dir_of(tmp_path))
    assert [row["update"] for row in rows] == [0, 1, 2, 3]
    assert rows[1]["async/token_staleness_max"] == 0 and rows[1]["buffer/staleness_max"] == 0
    assert all(0 <= row["async/token_staleness_min"] <= row["async/token_staleness_max"] <= 1 for row in rows[1:])
    assert all(0 <= row["async/mixed_version_responses"] <= 1 and row["async/vllm_in_flight"] > 0 for row in rows[1:])
