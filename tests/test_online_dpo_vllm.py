"""The asynchronous machinery (weight_handoff.py, vllm_engine.py, generator.py) as online_dpo_vllm.py drives it:
weights handed to vLLM, generator failure. (Its runs, learning,
resume, off-policy steps under DeepSpeed and bad input are in test_scripts_run.py with the other scripts.)"""

import concurrent.futures
import contextlib
import copy
import functools
import glob
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import vllm
from conftest import CPU_WEIGHT_TRANSFER, ROOT, TINY, read_metrics, run_dir_of, run_patched
from transformers import (AutoModelForCausalLM, AutoTokenizer, Gemma2Config, Gemma2ForCausalLM, LlamaConfig,
                          LlamaForCausalLM)
from vllm.inputs import TokensPrompt

import data
import online_dpo_vllm as script
import vllm_engine
import weight_handoff

pytestmark = pytest.mark.slow  # runs scripts or vLLM engines: minutes

# Longer than one KV block (32 tokens here, see below) and sharing their first block: vLLM's prefix
# cache then holds keys and values of that block, which a weight push must not leave behind.
SHARED = "SUBREDDIT: r/travel\nPOST: " + " ".join(["today we went to the beach and it was big and new"] * 3)
PROMPTS = [SHARED + " rain hotel\nTL;DR:", SHARED + " code router\nTL;DR:", SHARED + " salad\nTL;DR:"]


def _policy(kind, tokenizer):
    """The tiny SFT model (GPT-NeoX), or a random Llama or Gemma-2, with weights large enough that greedy choices are
    clear-cut. Gemma-2's output layer is its embedding (tied), and vLLM's Gemma2ForCausalLM has no output layer."""
    if kind == "gpt_neox":
        return AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    torch.manual_seed(0)
    config_class, model_class = (LlamaConfig, LlamaForCausalLM) if kind == "llama" else (Gemma2Config, Gemma2ForCausalLM)
    config = config_class(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=2, head_dim=64, max_position_embeddings=128,
                          initializer_range=0.2, pad_token_id=tokenizer.pad_token_id,
                          eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                          tie_word_embeddings=kind == "gemma2")
    if kind == "gemma2":  # vLLM's CPU attention leaves its soft-capping out (log-probabilities 0.01 apart with it)
        config.attn_logit_softcapping = None
    return model_class(config)


def _truncated(responses, tokenizer):
    """Responses as the script trains on them: cut after the stop token and at a sampled pad token."""
    responses = script.truncate_response(responses, tokenizer.eos_token_id, tokenizer.pad_token_id)
    return [[t for t in row if t != tokenizer.pad_token_id] for row in responses.tolist()]


def _greedy_hf(model, prompts, tokenizer, length):
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    return _truncated(script.generate(model, data.left_pad(prompts, pad, "cpu"), pad, eos, length), tokenizer)


def _vllm_generate(llm, prompts, k, length, stop_id, temperature, seed):
    """The generator's batch: k samples of each prompt (request n seeded seed + n), their tokens and log-probabilities."""
    sampled = vllm_engine.generate_batch(llm, prompts, k, lambda n: script.sampling_params(length, stop_id, temperature,
                                                                                            seed + n))
    return [list(tokens) for tokens, _ in sampled], [list(logprobs) for _, logprobs in sampled]


def _greedy_vllm(llm, prompts, tokenizer, length):
    responses = _vllm_generate(llm, prompts, 1, length, tokenizer.eos_token_id, temperature=0, seed=0)[0]
    return _truncated(data.right_pad(responses, tokenizer.pad_token_id, "cpu"), tokenizer)


def _logprobs_vllm(llm, prompts, length):
    """vLLM's log-probabilities of the 5 likeliest tokens at each step of its greedy responses: {(prompt,
    prefix of the response, token): log-probability}."""
    sampling = vllm.SamplingParams(temperature=0, max_tokens=length, logprobs=5)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sampling, use_tqdm=False)
    return {(i, tuple(o.outputs[0].token_ids[:j]), token): logprob.logprob for i, o in enumerate(outputs)
            for j, step in enumerate(o.outputs[0].logprobs) for token, logprob in step.items()}


def _logprobs_hf(model, prompts, keys):
    out = {}
    for i, prefix, token in keys:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompts[i] + list(prefix)])).logits[0, -1]
        out[i, prefix, token] = torch.log_softmax(logits.float(), -1)[token].item()
    return out


def _train(model, prompts, tokenizer, answer):
    """Train the HF model a little, until it answers `answer` to every prompt."""
    target = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(30):
        for prompt in prompts:
            ids = torch.tensor([prompt + target])
            loss = model(input_ids=ids, labels=ids.masked_fill(torch.arange(ids.shape[1]) < len(prompt), -100)).loss
            loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


@pytest.mark.parametrize("kind", ["gpt_neox", "llama", "gemma2"])
def test_after_a_weight_push_vllm_greedy_equals_hf_greedy(tmp_path, monkeypatch, kind):
    """Both hand-offs: in memory (vLLM's weight transfer; on this CPU tests/cpu_weight_transfer's gloo) and, after more training, through a
    save_pretrained directory (--weight-sync file)."""
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "sft"))
    model = _policy(kind, tokenizer).eval()
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    model.save_pretrained(tmp_path / "v0")
    tokenizer.save_pretrained(tmp_path / "v0")
    assert min(len(p) for p in prompts) > 32 and len({tuple(p[:32]) for p in prompts}) == 1
    # vLLM on a GPU caches blocks of 16 tokens; on a CPU 128 unless told: 32 makes the shared block cacheable.
    monkeypatch.setattr(vllm, "LLM", functools.partial(vllm.LLM, block_size=32))
    args = script.Args(bf16=False, response_length=12, batch_size=8, vllm_enforce_eager=True)
    args.world_size = 1
    llm = vllm_engine.start_vllm(args, str(tmp_path / "v0"), weight_transfer=True)
    try:
        if kind == "gpt_neox":  # the same seed gives the same batch whatever vLLM ran before; another seed another
            first = _vllm_generate(llm, prompts, 2, 12, tokenizer.eos_token_id, temperature=0.7, seed=5)
            _vllm_generate(llm, prompts, 4, 12, tokenizer.eos_token_id, temperature=0.7, seed=9)
            assert first == _vllm_generate(llm, prompts, 2, 12, tokenizer.eos_token_id, temperature=0.7, seed=5)
            assert first != _vllm_generate(llm, prompts, 2, 12, tokenizer.eos_token_id, temperature=0.7, seed=6)
            assert len(first[0]) == 6 and first[0][0] != first[0][3]  # two different samples of the first prompt
        before = _greedy_vllm(llm, prompts, tokenizer, 12)
        assert before == _greedy_hf(model, prompts, tokenizer, 12)
        # Train the HF model a little (it learns to answer "beach plane"), then hand the weights over in memory.
        _train(model, prompts, tokenizer, " beach plane")
        transfer = weight_handoff.weight_transfer(args, llm, model, rank=0)
        weight_handoff.send_weights(transfer, 1)
        transfer.finish()  # the generator's part: vLLM's worker has loaded the weights, the update is finished
        after = _greedy_vllm(llm, prompts, tokenizer, 12)
        after_logprobs = _logprobs_vllm(llm, prompts, 4)
        sampled, behaviour_logprobs = _vllm_generate(llm, prompts, 2, 12, tokenizer.eos_token_id,
                                                           temperature=0.7, seed=3)
        assert after == _greedy_hf(model, prompts, tokenizer, 12)
        # Through a directory: the fallback, and the way the first version reaches vLLM in every run.
        after_model = copy.deepcopy(model)
        _train(model, prompts, tokenizer, " code router")
        weight_handoff.write_for_vllm(model, model.state_dict(), tmp_path / "v2")
        vllm_engine.load_into_vllm(llm, str(tmp_path / "v2"))
        assert _greedy_vllm(llm, prompts, tokenizer, 12) == _greedy_hf(model, prompts, tokenizer, 12) != after
    finally:
        vllm_engine.shut_down(llm)
    model = after_model
    # ... with the new weights' probabilities: no key or value of the shared block survives from the old weights.
    expected = _logprobs_hf(model, prompts, after_logprobs)
    difference = max(abs(after_logprobs[key] - expected[key]) for key in expected)
    assert len(expected) >= 30 and difference < 1e-4, difference  # measured: 3e-6 with the reset, 0.5-2.5 without
    assert after != before  # the push changed what vLLM generates
    # The log-probabilities vLLM returns with its samples (the behaviour policy's, which the off-policy correction
    # divides by) are the pushed weights' at the sampling temperature, token for token.
    difference = 0.0
    for prompt, response, logprobs in zip(prompts * 2, sampled, behaviour_logprobs):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0, len(prompt) - 1: -1]
        hf = torch.log_softmax(logits / 0.7, -1).gather(1, torch.tensor(response)[:, None])[:, 0]
        assert len(logprobs) == len(response)
        difference = max(difference, (torch.tensor(logprobs) - hf).abs().max().item())
    assert difference < 1e-4, difference
    assert all(response[-1] == tokenizer.eos_token_id for response in after)  # the stop token is kept


def test_an_engine_killed_during_an_in_memory_push_ends_it_within_seconds(tmp_path):
    """vLLM's engine process dies while the learner is sending it weights: the hand-off raises an error saying so,
    instead of waiting for a receiver that is gone (a hang here is the field's most reported failure)."""
    model = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    args = script.Args(bf16=False, response_length=12, batch_size=8, vllm_enforce_eager=True)
    args.world_size = 1
    llm = vllm_engine.start_vllm(args, os.path.join(TINY, "sft"), weight_transfer=True)
    (engine,) = [p for p in psutil.Process().children(recursive=True)
                 if p.cmdline() and p.cmdline()[0].startswith("VLLM::EngineCore")]

    class KillingWeights(weight_handoff.PolicyWeights):  # the engine dies after the first tensors have gone
        def __iter__(self):
            for i, item in enumerate(super().__iter__()):
                if i == 3:
                    engine.send_signal(signal.SIGKILL)
                yield item

    transfer = weight_handoff.weight_transfer(args, llm, model, rank=0)
    transfer.source = KillingWeights(model)
    start = time.time()
    try:
        # The learner's side fails if the bytes cannot go; else the generator's, finishing the update, does.
        with pytest.raises(RuntimeError, match="handing version 1 of the policy to vLLM failed|engine process died"):
            weight_handoff.send_weights(transfer, 1)
            transfer.finish()
    finally:
        vllm_engine.shut_down(llm)
    assert time.time() - start < 30


# vLLM's worker stops answering (SIGSTOP) after the learner has begun a push: the learner is then stuck in the
# broadcast, where no timeout of the collective's own helps on a GPU (NCCL has none). Its watchdog must end it.
HUNG_PUSH = """
import atexit, os, signal, sys
import psutil
from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM
import data
import online_dpo_vllm as script
import vllm_engine
import weight_handoff

tokenizer = AutoTokenizer.from_pretrained(sys.argv[2])
model = GPTNeoXForCausalLM(GPTNeoXConfig(vocab_size=len(tokenizer), hidden_size=512, intermediate_size=2048,
                                         num_hidden_layers=4, num_attention_heads=8, max_position_embeddings=128))
model.save_pretrained(sys.argv[1])  # 50 MB: more than sockets buffer, so the broadcast waits for vLLM
tokenizer.save_pretrained(sys.argv[1])
args = script.Args(bf16=False, response_length=12, batch_size=8, vllm_enforce_eager=True,
                   generation_timeout=5 if sys.argv[3] == "stop" else 60)
args.world_size = 1
llm = vllm_engine.start_vllm(args, sys.argv[1], weight_transfer=True)
atexit.register(llm.llm_engine.engine_core.shutdown)  # (the scripts' generator.close waits up to 30 s)
(worker,) = [p for p in psutil.Process().children(recursive=True) if p.cmdline()[:1] == ["VLLM::Worker"]]
transfer = weight_handoff.weight_transfer(args, llm, model, 0)


class StoppingWeights(weight_handoff.PolicyWeights):  # vLLM's worker stops once the push has begun
    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == 3:
                worker.send_signal(signal.SIGSTOP)
            yield item


class RaisingWeights(weight_handoff.PolicyWeights):  # the learner's end fails once the push has begun
    def __iter__(self):
        for i, item in enumerate(super().__iter__()):
            if i == 3:
                raise RuntimeError("the learner ran out of memory")
            yield item


if sys.argv[3] == "stop":
    transfer.source = StoppingWeights(model)
elif sys.argv[3] == "raise":
    transfer.source = RaisingWeights(model)
else:  # vLLM's worker may not take more memory than it has now: it cannot allocate its receive buffer (50 MB)
    limit = worker.memory_info().vms + 16 * 2**20
    worker.rlimit(psutil.RLIMIT_AS, (limit, limit))
print("pushing", flush=True)
try:
    weight_handoff.send_weights(transfer, 1)
except RuntimeError as error:
    print("raised:", error, flush=True)
    raise
print("the push returned")
"""


def _hung_push(tmp_path, how):
    """Runs HUNG_PUSH; returns its return code, stdout, stderr's "error:" lines, the seconds from the push to its end,
    and its processes still alive after it."""
    stderr_file = open(tmp_path / "stderr.txt", "w+")
    process = subprocess.Popen([sys.executable, "-c", HUNG_PUSH, str(tmp_path / "model"), os.path.join(TINY, "sft"),
                                how],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=stderr_file, text=True,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, CPU_WEIGHT_TRANSFER])}, start_new_session=True)
    family, pushing = [], None
    deadline = threading.Timer(300, process.kill)  # (a hung process fails the test, not the suite)
    deadline.start()
    try:
        while pushing is None:  # the engine's processes, once it has started
            line = process.stdout.readline()
            assert line, open(tmp_path / "stderr.txt").read()[-3000:]
            if line.startswith("pushing"):
                pushing = time.time()
                family = psutil.Process(process.pid).children(recursive=True)
        # Read on through the same buffered stream: what the process printed right after "pushing" (the "raise"
        # case's line) may already sit in its buffer, which communicate(), reading the pipe itself, would skip.
        stdout = process.stdout.read()
        process.wait()
        took = time.time() - pushing
        stderr_file.seek(0)
        stderr = stderr_file.read()
        alive = [p for p in psutil.wait_procs(family, timeout=10)[1] if p.status() != psutil.STATUS_ZOMBIE]
    finally:
        for p in family:  # a stopped process would stay for ever
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        os.killpg(process.pid, signal.SIGKILL) if process.poll() is None else None
        deadline.cancel()
        stderr_file.close()
    return process.returncode, stdout, [line for line in stderr.splitlines() if line.startswith("error:")], took, alive


@pytest.fixture(scope="module")
def hung_pushes(tmp_path_factory):
    """The three ways of _hung_push at once: their processes mostly wait (on vLLM's start, a stopped worker, a
    timeout), so three take the time of about one."""
    hows = ["stop", "out of memory", "raise"]
    directories = [tmp_path_factory.mktemp("push") for _ in hows]  # (mktemp is not thread-safe)
    with concurrent.futures.ThreadPoolExecutor(len(hows)) as pool:
        return dict(zip(hows, pool.map(_hung_push, directories, hows)))


def test_a_hand_off_stuck_in_the_broadcast_ends_with_one_line_naming_the_step(hung_pushes):
    returncode, stdout, errors, took, alive = hung_pushes["stop"]
    # update_weights, the worker's receiving end, is the call in flight; it times out at 5 s, then the watchdog
    # gives the stuck broadcast 5 s more to end on its own
    assert errors == ["error: weight hand-off: update_weights took more than 5 s (--generation-timeout)"]
    assert returncode == 1 and "the push returned" not in stdout and 9 < took < 30, (returncode, took)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_hand_off_that_vllms_worker_fails_ends_within_seconds_naming_the_cause(hung_pushes):
    """vLLM's worker raises in update_weights (out of memory for its receive buffer) and leaves the learner alone in
    the broadcast: the failure is recorded as it happens, and the watchdog ends the run 5 s later, naming it."""
    returncode, stdout, errors, took, alive = hung_pushes["out of memory"]
    assert len(errors) == 1 and errors[0].startswith("error: weight hand-off: update_weights failed in vLLM: "), errors
    assert "memory" in errors[0], errors
    # (before the failure was recorded it would be --generation-timeout, 60 s here, and 5 s more; 10 s seen alone,
    # 19.5 s beside two other engines and another test process)
    assert returncode == 1 and "the push returned" not in stdout and took < 30, (returncode, took)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_hand_off_that_fails_on_the_learners_side_raises_and_exits_at_once(hung_pushes):
    """The learner's end raises in the middle of a push (as CUDA would, out of memory while packing): the error goes up
    as usual and the process exits within seconds. Python joins vLLM's sender thread at exit, where the worker's
    update_weights waits for the rest of the broadcast: it must end then, not at --generation-timeout (60 s here)."""
    returncode, stdout, errors, took, alive = hung_pushes["raise"]
    assert "raised: handing version 1 of the policy to vLLM failed: the learner ran out of memory" in stdout, (
        returncode, errors, took, stdout[-2000:])
    assert returncode == 1 and not errors and took < 15, (returncode, errors, took)
    assert not alive, [(p.pid, p.name()) for p in alive]


def test_a_dead_generator_stops_the_run_with_its_error(tmp_path):
    """Kill vLLM's engine process in the middle of a run: the learner must exit non-zero within seconds, in one line
    naming what died, how, at which update and what to resume from (no traceback), and leave no process behind."""
    process = subprocess.Popen([sys.executable, "online_dpo_vllm.py", "--vllm-enforce-eager", "--output-dir",
                                str(tmp_path)], cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob("*__*/metrics.jsonl")) or len(read_metrics(run_dir_of(tmp_path))) < 3:
            assert process.poll() is None and time.time() < deadline, "the run ended or stalled before training"
            time.sleep(0.5)
        children = psutil.Process(process.pid).children(recursive=True)
        (engine,) = [p for p in children if p.cmdline() and p.cmdline()[0].startswith("VLLM::EngineCore")]
        engine.send_signal(signal.SIGKILL)
        killed = time.time()
        stderr = process.communicate(timeout=60)[1]
    finally:
        if process.poll() is None:
            process.kill()
    assert process.returncode == 1
    assert time.time() - killed < 30, "the learner took too long to notice"
    errors = [line for line in stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert re.match(r"error: the generator failed: vLLM's engine process died, killed by SIGKILL \(update \d+\); "
                    r"no checkpoint was written yet", errors[0]), errors
    time.sleep(2)
    assert not [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE], "processes left behind"


def test_vllm_never_outlives_a_learner_killed_with_sigkill(tmp_path):
    """A scheduler's pre-emption or the out-of-memory killer ends the learner with SIGKILL, where nothing of it runs:
    vLLM's engine and worker processes must still end (on a GPU they would keep vLLM's memory from the --resume)."""
    process = subprocess.Popen([sys.executable, "online_dpo_vllm.py", "--vllm-enforce-eager", "--output-dir",
                                str(tmp_path)], cwd=ROOT, env={**os.environ, "WANDB_MODE": "offline"},
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not list(tmp_path.glob("*__*/metrics.jsonl")) or len(read_metrics(run_dir_of(tmp_path))) < 2:
            assert process.poll() is None and time.time() < deadline, "the run ended or stalled before training"
            time.sleep(0.5)
        children = psutil.Process(process.pid).children(recursive=True)
        assert any(p.cmdline() and p.cmdline()[0].startswith("VLLM::EngineCore") for p in children)
    finally:
        process.kill()
    process.wait()
    for left in glob.glob(f"/dev/shm/*-{process.pid}-weights"):  # SIGKILL leaves no time to clean up
        shutil.rmtree(left)
    deadline = time.time() + 20
    while [p for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] and time.time() < deadline:
        time.sleep(0.5)
    left = [(p.pid, p.name()) for p in children if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes outlived the learner: {left}"


# verl's and ms-swift's bug (the generator silently kept sampling from an old policy), made at each point where the
# weight check is scheduled: at the start (vLLM starts from the SFT model while the learner holds other weights, as a
# resume that forgot the checkpoint's would), after the first hand-off (version 1 never reaches vLLM: checked whatever
# --check-weights-every says); at every N-th, an adapter's: test_lora.py. The run itself, patched.
BROKEN = """
import runpy, sys, torch
import data, generator
version = int(sys.argv.pop(1))
load, load_into_vllm, start_vllm = data.load_model, generator.load_into_vllm, generator.start_vllm
def perturbed(args, path, reward=False, trained=False):
    model = load(args, path, reward, trained)
    if trained:
        with torch.no_grad():
            weight = next(model.parameters())  # the embeddings (a constant shift would leave the norms' outputs)
            weight.add_(0.1 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0)))
    return model
if version == 0:
    data.load_model = perturbed
    generator.start_vllm = lambda args, path, *rest, **options: start_vllm(args, args.sft_model_path, *rest, **options)
generator.load_into_vllm = lambda llm, path: None if path.endswith(f"policy-{version}") else load_into_vllm(llm, path)
sys.argv = ["online_dpo_vllm.py", *sys.argv[1:]]
runpy.run_path("online_dpo_vllm.py", run_name="__main__")
"""
BROKEN_AT = [(0, "5"), (1, "5")]  # (the version that vLLM does not hold, --check-weights-every)


@pytest.mark.parametrize("version, every", BROKEN_AT, ids=["at the start", "after the first hand-off"])
def test_a_policy_that_never_reaches_vllm_stops_the_run_at_its_scheduled_check(tmp_path, version, every):
    """The run stops at the check of the version vLLM does not hold, in one line naming it, instead of training on
    for ever from a stale policy."""
    result, errors = run_patched(BROKEN, str(version), "--vllm-enforce-eager", "--weight-sync", "file",
                                 "--check-weights-every", every, "--learning-rate", "1e-3", "--total-episodes", "512",
                                 "--eval-every", "0", "--num-eval-prompts", "8", "--output-dir", str(tmp_path))
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert len(errors) == 1 and errors[0].startswith(f"error: vLLM does not hold version {version} of the learner's "
                                                     "policy: its log-probabilities of the probe differ by "), errors
    logged = glob.glob(f"{tmp_path}/*__*/metrics.jsonl")
    assert len(read_metrics(os.path.dirname(logged[0])) if logged else []) <= version + 3, result.stderr[-3000:]
