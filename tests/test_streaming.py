"""--generation streaming: each token's policy version, as vLLM reports it, is the version that sampled it (its
log-probability is the learner's under that version), across hand-offs loaded while responses are in flight."""

import copy
import os
import shutil

import pytest
import torch
from conftest import TINY, read_metrics, run_dir_of, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
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


def test_a_streaming_batchs_metrics_count_its_tokens_by_staleness():
    """Two responses, of tokens of versions 3, 3, 4 and 2, trained by update 5 (the policy after 4 updates): staleness
    1, 1, 0 and 2; one of the two responses mixes versions."""
    batch = generator.GeneratedBatch(2, [[0]], [[[5, 6, 7], [8]]], [[[0.0] * 3, [0.0]]], None, 1.0, 0.0,
                                     [[[3, 3, 4], [2]]], {"in_flight": 3.0, "regenerated": 1})
    assert batch.stream_metrics(5) == {
        "async/tokens_stale_0": 0.25, "async/tokens_stale_1": 0.5, "async/tokens_stale_2": 0.25,
        "async/token_staleness_mean": 1.0, "async/token_staleness_max": 2.0, "async/token_staleness_min": 0.0,
        "async/mixed_version_responses": 0.5, "async/vllm_in_flight": 3.0, "async/regenerated_prompts": 1}
    assert batch._replace(stream=None).stream_metrics(5) == {}  # batch mode


def test_the_mismatch_kl_of_mixed_responses_is_the_batchs_over_its_ranks():
    """Rank 0 holds a response mixing versions (3 tokens) and one of one version (1 token), rank 1 one of each (4 and 2
    tokens). Each rank's per-token mean over its mixed responses, times its weight, averaged over the 2 ranks, is the
    mean over the batch's 7 mixed tokens (the scripts' async/mismatch_kl_mixed); likewise over the 3 others."""
    batch = generator.GeneratedBatch(2, [[0], [1]], None, None, None, 1.0, 0.0,
                                     [[[3, 3, 4], [2]], [[4, 4], [3, 4, 4, 4]]], {"in_flight": 1.0, "regenerated": 0})
    kinds = [batch.version_kinds(rank, "cpu") for rank in (0, 1)]
    assert [kinds[r]["mixed"][0].tolist() for r in (0, 1)] == [[True, False], [False, True]]
    assert [kinds[r]["one_version"][0].tolist() for r in (0, 1)] == [[False, True], [True, False]]
    assert [kinds[r]["mixed"][1] for r in (0, 1)] == [pytest.approx(6 / 7), pytest.approx(8 / 7)]
    assert [kinds[r]["one_version"][1] for r in (0, 1)] == [pytest.approx(2 / 3), pytest.approx(4 / 3)]
    # per-token values 1 on rank 0's mixed tokens, 8 on rank 1's: the batch's mean is (3 + 32) / 7 = 5
    assert (kinds[0]["mixed"][1] * 1 + kinds[1]["mixed"][1] * 8) / 2 == pytest.approx(5)
    assert batch._replace(stream=None).version_kinds(0, "cpu") == {}


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


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_with_lora_each_response_is_its_adapters_and_old_adapters_leave_vllm(tmp_path, request, model):
    """LoRA in streaming: vLLM cannot change a running request's adapter, so a version's adapter serves the requests
    that start after its load. Two groups start under version 0's adapter, two more after version 1's load (4 decoding
    steps in), then version 2 loads (10 steps in) with K = 1 and the next batch update 3's: version 0's groups, too old
    for it, stop and wait to be generated again, and version 0's adapter leaves vLLM and its directory. Every response
    is one version's, the one vLLM names, and each token's vLLM log-probability is peft's under that adapter (on the
    tiny model and on SmolLM2, tied embeddings)."""
    path = os.path.join(TINY, "sft") if model == "tiny" else os.path.join(request.getfixturevalue("smollm2"), "model")
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = rloo_vllm.Args(bf16=False, response_length=24, batch_size=8, temperature=1.0, vllm_enforce_eager=True,
                          max_prompt_length=32, seed=1, lora_rank=8, generation="streaming", off_policy_steps=1)
    args.world_size = 1
    policy = data.with_lora(args, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval())
    models, generator_ = [], torch.Generator().manual_seed(0)
    for version in range(3):  # each version's adapter a large step from the one before (a fresh one is the identity)
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_" in name:
                    parameter.add_(torch.randn(parameter.shape, generator=generator_) * 0.05)
        policy.save_pretrained(tmp_path / f"policy-{version}")
        models.append(copy.deepcopy(policy).eval())
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    llm = vllm_engine.start_vllm(args, path, lora_rank=8)
    try:
        adapter = vllm_engine.add_adapter(llm, 0, str(tmp_path / "policy-0"))
        thread = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                           rloo_vllm.batch_prompts, weights_dir=str(tmp_path), train_prompts=prompts,
                                           prompts_per_rank=4, k=2, stop_id=-1 % len(tokenizer), first_version=0,
                                           off_policy_steps=1, probe=None, in_memory=False, adapter=adapter)
        thread._submit(), thread._submit()
        for step in range(1, 200):
            if step == 4:
                thread._load(1, str(tmp_path / "policy-1"), None, None)
                assert thread._drop_old_adapters(oldest=0) == 0 and set(llm.llm_engine.list_loras()) == {1, 2}
                thread._submit(), thread._submit()
            if step == 10:
                thread._load(2, str(tmp_path / "policy-2"), None, None)
                assert thread._drop_old_adapters(oldest=1) == 2  # update 3's batch takes versions 1 and 2
                assert set(llm.llm_engine.list_loras()) == {2, 3} and not (tmp_path / "policy-0").exists()
                assert list(thread.again) == [0, 1] and set(thread.running) == {2, 3}
            thread._step(2 if step >= 10 else 1 if step >= 4 else 0)
            if not thread.running:
                break
    finally:
        vllm_engine.shut_down(llm)
    assert sorted(thread.done) == [2, 3]
    for group in thread.done:
        prompt = prompts[thread.untrained[group]]
        for tokens, logprobs, token_versions in thread.samples[group]:
            assert token_versions == [1] * len(tokens)
            with torch.no_grad():
                learner = _learner_logprobs(models[1], prompt, tokens)
            difference = (torch.tensor(logprobs, dtype=torch.float64) - learner).abs()
            assert difference.mean() <= weight_handoff.PROBE_TOLERANCE[False] and difference.max() <= 0.02, difference


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


def test_rloo_vllm_learns_with_an_adapter_in_streaming_mode_and_resumes(tmp_path):
    """test_lora's asynchronous LoRA run (adapter at 3e-3, checked every 2 updates), streaming: it learns, its weight
    checks hold, each response is one adapter's (no response mixes versions), no token is more than K = 1 versions
    behind, and a run resumed from its checkpoint at update 4 trains updates 5 and 6."""
    command = ["rloo_vllm.py", "--generation", "streaming", "--lora-rank", "8", "--learning-rate", "3e-3",
               "--vllm-enforce-eager", "--check-weights-every", "2", "--eval-every", "2", "--save-every", "2",
               "--num-eval-prompts", "64", "--total-episodes", "384"]
    whole = run_script(*command, "--output-dir", str(tmp_path / "whole"))
    assert "its LoRA adapter" in whole.stdout and whole.stdout.count("weight check:") == 1
    run_dir = run_dir_of(tmp_path / "whole")
    rows = read_metrics(run_dir)
    assert all(row["async/mixed_version_responses"] == 0 and row["async/token_staleness_max"] <= 1 for row in rows[1:])
    assert rows[1]["async/token_staleness_max"] == 0
    scores = [row["eval/scores"] for row in rows if "eval/scores" in row]
    assert scores[-1] - scores[0] > 1.0, scores
    shutil.rmtree(os.path.join(run_dir, "checkpoint-6"))
    last = rows[-1]
    run_script(*command, "--output-dir", str(tmp_path / "whole"), "--resume", run_dir)
    resumed = read_metrics(run_dir)
    assert [row["update"] for row in resumed] == list(range(7)) and resumed[6]["episode"] == last["episode"]
    assert resumed[6]["time/episodes_per_second"] != last["time/episodes_per_second"]  # (updates 5 and 6 again)
    assert all(row["async/mixed_version_responses"] == 0 for row in resumed[5:])
