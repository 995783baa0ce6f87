"""--generation streaming: each token's policy version, as vLLM reports it, is the version that sampled it (its
log-probability is the learner's under that version), across hand-offs loaded while responses are in flight."""

import copy
import functools
import os
import shutil

import pytest
import torch
from conftest import TINY, read_metrics, run_dir_of, run_script
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import generator
import grpo_tools_vllm
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


def _adapters(args, model_path, tmp_path, count):
    """The policy with a LoRA adapter and `count` later versions of it (each a peft save_pretrained directory vLLM adds
    as an adapter, and the model), each adapter a large step from the one before (a fresh one is the identity)."""
    policy = data.with_lora(args, AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval())
    versions, generator_ = [], torch.Generator().manual_seed(0)
    for version in range(count + 1):
        with torch.no_grad():
            for name, parameter in policy.named_parameters():
                if "lora_" in name:
                    parameter.add_(torch.randn(parameter.shape, generator=generator_) * 0.05)
        policy.save_pretrained(tmp_path / f"policy-{version}")
        versions.append((str(tmp_path / f"policy-{version}"), copy.deepcopy(policy).eval()))
    return versions


def _stream_args():
    args = rloo_vllm.Args(bf16=False, response_length=8, batch_size=8, vllm_enforce_eager=True, max_prompt_length=8,
                          seed=2, generation_timeout=120)
    args.world_size, args.num_updates, args.resume = 1, 6, None
    return args


@pytest.fixture(scope="module")
def tiny_llm():
    """One vLLM engine on the tiny SFT model for the tests that start from its weights (an engine costs about 20 s to
    start and stop here); a test that loads other weights into it loads the SFT model's first."""
    args = rloo_vllm.Args(bf16=False, response_length=24, batch_size=8, vllm_enforce_eager=True, max_prompt_length=32)
    args.world_size = 1
    llm = vllm_engine.start_vllm(args, os.path.join(TINY, "sft"))
    yield llm
    vllm_engine.shut_down(llm)


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
    # Episodes: the environment's tokens (sampled 0) are not the policy's and do not count.
    episodes = batch._replace(token_versions=[[[3, 1, 1, 4], [2]]], sampled=[[[1, 0, 0, 1], [1]]])
    shares = {f"async/tokens_stale_{s}": 1 / 3 for s in range(3)}
    assert episodes.stream_metrics(5) == {**batch.stream_metrics(5), **shares}


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


@pytest.mark.parametrize("model, reported", [("tiny", "the old version"), ("tiny", "as loaded"),  # (this order: the
                                             ("smollm2", "as loaded")])  # second shows that the reload restores)
def test_each_tokens_log_probability_is_that_of_the_version_vllm_reports_for_it(tmp_path, request, monkeypatch, model,
                                                                               reported):
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
    if model == "tiny":  # the module's engine, from the SFT weights again
        llm = request.getfixturevalue("tiny_llm")
        vllm_engine.load_into_vllm(llm, path)
    else:
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
                if reported == "the old version" and version == 2:  # loads version 2, still says 1
                    monkeypatch.setattr(llm.llm_engine, "set_weight_version", lambda _: None)
                thread._load(version, versions[version][0], None, None)
            thread._step(2 if step >= 10 else 1 if step >= 4 else 0)
            if not thread.running:
                break
    finally:
        if model != "tiny":
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


TOOLS = os.path.join(os.path.dirname(TINY), "tiny_tools")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_episodes_stream_turn_by_turn_token_in_token_out_each_token_its_versions(tmp_path, lora):
    """grpo_tools_vllm.py's episodes in the streaming generator (its environment, the calculator, at most 3 turns): 8
    prompts x 4 episodes of up to 32 tokens, versions 1 and 2 loaded while turns are in flight (after 3 and 11 decoding
    steps). Each episode's next turn goes to vLLM as its last ends, its context the prompt and the ids so far, as vLLM
    sampled them and the environment appended them; the batch the learner takes holds, position by position, vLLM's
    turns and the environment's ids between them (sampled 1 and 0), each policy token with the version vLLM reports for
    it and vLLM's log-probability, which is the learner's under that version (the weight check's tolerance; 0.02 for
    one token). With LoRA (version 2's adapter added as soon as a turn runs under version 1's) each turn is its
    adapter's, the newest when it started (an episode's turns under two), and after each load vLLM holds the adapters
    of the groups running, of the turns running and the newest, no other; at the end, the newest alone."""
    path = os.path.join(TOOLS, "sft")
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = grpo_tools_vllm.Args(bf16=False, response_length=32, batch_size=32, temperature=1.0, max_turns=3,
                                vllm_enforce_eager=True, max_prompt_length=32, seed=1, lora_rank=8 * lora,
                                generation="streaming", off_policy_steps=2)
    args.world_size = 1
    versions = _adapters(args, path, tmp_path, 2) if lora else _versions(path, tmp_path, 2)
    env = grpo_tools_vllm.make_calculator(args, tokenizer, tokenizer.eos_token_id)
    prompts = [tokenizer.encode(f"Question: What is {a} * {b}?\n") for a, b in
               [(47, 38), (21, 96), (55, 13), (82, 64), (19, 37), (73, 58), (36, 91), (64, 27)]]
    llm = vllm_engine.start_vllm(args, path, lora_rank=args.lora_rank)
    requests, turns = [], []  # vLLM's requests (id, context, adapter), finished turns (id, ids, logprobs, versions)
    add, step = llm.llm_engine.add_request, llm.llm_engine.step

    def spy_add(request, prompt, *rest, lora_request=None, **kwargs):
        requests.append((request, list(prompt["prompt_token_ids"]), lora_request and lora_request.lora_name))
        return add(request, prompt, *rest, lora_request=lora_request, **kwargs)

    def spy_step():
        outputs = step()
        turns.extend((o.request_id, *vllm_engine.sampled_tokens(o.outputs[0]), generator.token_versions(o, 2))
                     for o in outputs if o.finished)
        return outputs

    llm.llm_engine.add_request, llm.llm_engine.step = spy_add, spy_step
    try:
        thread = generator.StreamingThread(
            args, llm, functools.partial(grpo_tools_vllm.turn_request, env), grpo_tools_vllm.generating_version,
            grpo_tools_vllm.batch_prompts, weights_dir=str(tmp_path), train_prompts=prompts, prompts_per_rank=8, k=4,
            stop_id=tokenizer.eos_token_id, first_version=0, off_policy_steps=2, probe=None, in_memory=False,
            environment=functools.partial(grpo_tools_vllm.environment_step, env),
            adapter=vllm_engine.add_adapter(llm, 0, versions[0][0]) if lora else None)
        llm.llm_engine.set_weight_version("0")
        loaded, kept_for_a_turn = 0, False  # (LoRA: version 1's adapter kept while a turn uses it)
        for _ in range(8):
            thread._submit()
        for step_ in range(1, 300):
            # Version 1 after 3 steps; version 2 after 11 (LoRA: as soon as a turn runs under version 1's adapter).
            turning = any(state[6] == "policy-1" for state in thread.episodes.values())
            if step_ == 3 or loaded == 1 and (turning if lora else step_ == 11):
                loaded += 1
                thread._load(loaded, versions[loaded][0], None, None)
            if lora and loaded == 2:
                assert thread._drop_old_adapters(oldest=0) == 0  # (no group too old: all of version 0)
                assert set(thread.adapters) == ({0, 1, 2} if turning else {0, 2})  # (before vLLM, which a drop kills)
                assert set(llm.llm_engine.list_loras()) == {version + 1 for version in thread.adapters}  # (its ids)
                kept_for_a_turn = kept_for_a_turn or turning
            thread._step(loaded)
            if not thread.running:
                break
        if lora:  # nothing runs: every adapter but the newest leaves
            thread._drop_old_adapters(oldest=0)
            assert set(thread.adapters) == {2} and set(llm.llm_engine.list_loras()) == {3}
    finally:
        vllm_engine.shut_down(llm)
    assert len(thread.done) == 8 and not thread.episodes
    batch = thread._batch(thread.done, 0.0, 0.0, {"in_flight": 1.0, "regenerated": 0})
    # Each episode from vLLM's requests and turns alone, the environment's ids computed here from each turn.
    expected, turn_adapters = {}, set()  # {request: [ids, sampled, log-probabilities, versions, turns]}
    for request, context, adapter in requests:
        ids, own, logprobs, token_versions, _ = episode = expected.setdefault(request, [[], [], [], [], 0])
        assert context == prompts[thread.untrained[int(request.split("/")[0])]] + ids  # the prompt, the ids so far
        _, tokens, turn_logprobs, turn_versions = turns.pop(next(i for i, t in enumerate(turns) if t[0] == request))
        if lora:  # the turn is its adapter's, named with the request
            assert turn_versions == [int(adapter.removeprefix("policy-"))] * len(tokens), (turn_versions, adapter)
            turn_adapters.add((request, adapter))
        episode[4] += 1
        result, _ = grpo_tools_vllm.environment_step(env, tokens, episode[4], 32 - len(ids) - len(tokens))
        ids += tokens + result
        own += [1] * len(tokens) + [0] * len(result)
        logprobs += turn_logprobs + [0.0] * len(result)
        token_versions += turn_versions + turn_versions[-1:] * len(result)  # (the turn's, counted nowhere)
    order = [f"{group}/{j}" for j in range(4) for group in thread.done]
    assert [expected[request][:4] for request in order] == [list(columns) for columns in zip(
        batch.responses[0], batch.sampled[0], batch.logprobs[0], batch.token_versions[0])]
    two_turns, differences, versions_seen = 0, [], set()
    for request, response, logprobs, token_versions, own in zip(order, batch.responses[0], batch.logprobs[0],
                                                                  batch.token_versions[0], batch.sampled[0]):
        two_turns += 0 in own and own[-1] == 1
        prompt = prompts[thread.untrained[int(request.split("/")[0])]]
        by_version = {v: _learner_logprobs(versions[v][1], prompt, response) for v in set(token_versions)}
        for i in [i for i in range(len(response)) if own[i]]:
            differences.append(abs(logprobs[i] - by_version[token_versions[i]][i].item()))
            versions_seen.add(token_versions[i])
    differences = torch.tensor(differences)
    assert differences.mean() <= weight_handoff.PROBE_TOLERANCE[False] and differences.max() <= 0.02, differences
    # (LoRA: version 2's adapter serves only the turns that start after its load, which may be none)
    assert two_turns >= 2 and (versions_seen == {0, 1, 2} or lora and versions_seen >= {0, 1}), versions_seen
    if lora:
        assert len(turn_adapters) > len({request for request, _ in turn_adapters})  # an episode under two adapters
        assert kept_for_a_turn


def test_with_lora_each_response_is_its_adapters_and_old_adapters_leave_vllm(tmp_path):
    """LoRA in streaming: vLLM cannot change a running request's adapter, so a version's adapter serves the requests
    that start after its load. Two groups start under version 0's adapter, two more after version 1's load (4 decoding
    steps in), then version 2 loads (10 steps in) with K = 1 and the next batch update 3's: version 0's groups, too old
    for it, stop and wait to be generated again, and version 0's adapter leaves vLLM and its directory. Every response
    is one version's, the one vLLM names, and each token's vLLM log-probability is peft's under that adapter. (On
    SmolLM2, vLLM's log-probabilities under each adapter version are peft's: test_lora.py.)"""
    path = os.path.join(TINY, "sft")
    tokenizer = AutoTokenizer.from_pretrained(path)
    args = rloo_vllm.Args(bf16=False, response_length=24, batch_size=8, temperature=1.0, vllm_enforce_eager=True,
                          max_prompt_length=32, seed=1, lora_rank=8, generation="streaming", off_policy_steps=1)
    args.world_size = 1
    models = [model for _, model in _adapters(args, path, tmp_path, 2)]
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


def test_a_batch_whose_groups_finished_in_the_weight_checks_steps_goes_out(tiny_llm, tmp_path):
    """The last batch's groups may all finish while the generator checks a version's weights (the probe's decoding
    steps, between two of its loop's): with nothing left to generate, that batch still goes out. (It waited for a
    version that never came: a resumed LoRA run, whose first hand-off is checked, hung in CI.)"""
    args = _stream_args()
    args.num_updates, args.generation_timeout = 1, 30
    thread = generator.StreamingThread(args, tiny_llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                       rloo_vllm.batch_prompts, weights_dir=str(tmp_path),
                                       train_prompts=[[5, 6, 7]] * 2, prompts_per_rank=2, k=2, stop_id=3,
                                       first_version=0, off_policy_steps=1, probe=None, in_memory=False)
    tiny_llm.llm_engine.set_weight_version("0")
    thread._submit(), thread._submit()
    while thread.running:  # as in _load()'s weight check
        thread._step(0)
    thread.start()
    try:
        batch = thread.get()
    finally:
        thread.stopping.set()
        thread.thread.join(timeout=30)
    assert batch.stream["groups"] == [0, 1] and batch.stream["in_flight"] > 0 and not thread.done


def test_a_resumed_stream_trains_every_prompt_it_drew_once(tiny_llm, tmp_path):
    """The streaming generator stopped after two batches of 4 prompts (its requests in flight dropped, as a killed run's
    are) and a second one resumed from its state() for four more: every prompt drawn from the script's order is trained
    on once, or is still drawn and untrained at the end, on its way to a batch; none is lost, none trained twice. A
    generator stopped in the middle of a batch of the order goes on from the next prompt."""
    args, llm = _stream_args(), tiny_llm
    prompts = [[5, 6 + i, 7] for i in range(12)]  # 12 prompts: batches of 4 go through them in shuffled epochs
    common = dict(weights_dir=str(tmp_path), train_prompts=prompts, prompts_per_rank=4, k=2, stop_id=3, probe=None,
                  in_memory=False, off_policy_steps=10)  # (K = 10: no batch waits for a version)
    trained = []
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


def test_grpo_tools_vllm_streams_its_episodes_learns_and_resumes(tmp_path):
    """grpo_tools_vllm.py --generation streaming on the tiny tool task, 4 updates of 64 episodes of at most two turns,
    the weights checked at updates 1, 2 and 4: episodes go on after their calls, no policy token is more than K = 1
    versions behind, the greedy accuracy and the tool rate rise, and a run resumed from its checkpoint at update 2
    trains updates 3 and 4 (its episodes in flight generated again from their prompts)."""
    command = ["grpo_tools_vllm.py", "--generation", "streaming", "--max-turns", "2", "--learning-rate", "3e-4",
               "--total-episodes", "256", "--per-device-train-batch-size", "64", "--eval-every", "4",
               "--num-eval-prompts", "16", "--save-every", "2", "--check-weights-every", "2", "--vllm-enforce-eager"]
    whole = run_script(*command, "--output-dir", str(tmp_path))
    assert whole.stdout.count("weight check:") == 1
    run_dir = run_dir_of(tmp_path)
    rows = read_metrics(run_dir)
    assert [row["update"] for row in rows] == list(range(5))
    assert all(row["tools/turns"] > 1 and row["tools/environment_tokens"] > 0 for row in rows[1:]), rows
    assert all(row["async/token_staleness_max"] <= 1 for row in rows[1:]) and rows[1]["async/token_staleness_max"] == 0
    assert rows[4]["eval/scores"] > rows[0]["eval/scores"] + 0.3, (rows[0]["eval/scores"], rows[4]["eval/scores"])
    assert rows[4]["tools/tool_rate"] > rows[1]["tools/tool_rate"], [row["tools/tool_rate"] for row in rows[1:]]
    shutil.rmtree(os.path.join(run_dir, "checkpoint-4"))
    run_script(*command, "--output-dir", str(tmp_path), "--resume", run_dir)
    resumed = read_metrics(run_dir)
    assert [row["update"] for row in resumed] == list(range(5)) and resumed[4]["episode"] == 256
    assert resumed[4]["time/episodes_per_second"] != rows[4]["time/episodes_per_second"]  # (updates 3 and 4 again)
    assert all(row["tools/turns"] > 1 and row["async/token_staleness_max"] <= 1 for row in resumed[3:])
