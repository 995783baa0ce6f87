"""The run log says when a policy collapses (the README's LoRA command once collapsed with no word in its log): every
response empty, the learner's entropy run away, or a KL to the reference of more than a nat a token; once each."""

import dataclasses
import json
import os
import sys
import types

import pytest

import runlog
import timeline


def update_metrics(length=12.0, entropy=0.5, kl=3.0, key="objective/kl"):
    return {"episode": 64, "val/response_length": length, "policy/entropy_avg": entropy, key: kl,
            "objective/scores": 0.5, "time/episodes_per_second": 100.0}


def test_collapse_signs_against_the_first_update():
    first = update_metrics()
    assert runlog.collapse_signs(2, update_metrics(), 1, first) == []
    assert runlog.collapse_signs(2, update_metrics(entropy=1.0, kl=36.0), 1, first) == []  # twice, 3 nats: not above
    # the README's LoRA command at 3e-3 (rloo_vllm.py --lora-rank 8, seed 1), updates 1 and 12
    kinds = [kind for kind, _ in runlog.collapse_signs(12, update_metrics(length=12.1, entropy=5.15, kl=49.3), 1,
                                                       update_metrics(length=2.9, entropy=2.05, kl=0.0))]
    assert kinds == ["entropy", "kl"]  # 5.15 > 2 x 2.05; 49.3 / 12.1 = 4.1 nats a token
    (sign,) = runlog.collapse_signs(20, update_metrics(length=0.0, entropy=0.2, kl=0.0), 1, first)
    assert sign[0] == "empty" and sign[1].startswith("the responses are 0.00 tokens long on average"), sign
    (sign,) = runlog.collapse_signs(5, update_metrics(kl=37.2, key="pairs/kl"), 1, first)  # online DPO's KL
    assert sign == ("kl", "the KL to the reference is 3.10 nats a token (37.20 a response): the policy has run far "
                          "from it (a learning rate too high, or a KL coefficient too low?)")


def test_the_run_log_warns_once_a_sign_and_keeps_every_update(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(runlog.dist, "get_rank", lambda: 0)  # one process (close() gathers the timelines)
    monkeypatch.setattr(runlog.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(runlog.dist, "gather_object", lambda events, ranks, dst: ranks.__setitem__(0, events))
    args = types.SimpleNamespace(num_updates=30, batch_size=64, resume=None, track=False)
    log = runlog.RunLog(args, str(tmp_path), "run", 0, 0)
    log.log(0, {"episode": 0, "eval/scores": 0.1})  # an evaluation alone: no update's figures
    for update, entropy in enumerate([0.5, 0.6, 1.1, 1.5, 0.4], start=1):
        log.log(update, {**update_metrics(entropy=entropy), "episode": 64 * update})
    log.close()
    warnings = [line for line in capsys.readouterr().err.splitlines() if line.startswith("warning:")]
    assert warnings == ["warning: update 3: policy/entropy_avg 1.100 is more than twice update 1's 0.500: the policy "
                        "may be collapsing (a learning rate too high?)"], warnings
    assert [json.loads(line)["update"] for line in open(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3, 4, 5]
    assert json.load(open(tmp_path / "trace.json"))["traceEvents"][0]["args"] == {"name": "rank 0"}


def test_an_updates_time_shares_from_its_metrics_and_the_generators_phases():
    """An update of 10 s (from the last log) in which the learner waited 2 s for its batch and vLLM's thread generated
    for 4 s, loaded for 1 s and waited otherwise: learner idle 0.2, vLLM idle 0.5, and overlapping 4 s of generation
    with 8 s of the learner's work would be (4 + 8) / 8 = 1.5 times as fast as taking turns."""
    def event(name, start, seconds, thread="generator"):
        return {"name": name, "ts": round(start * 1e6), "dur": round(seconds * 1e6), "tid": thread}

    events = [event("generate a batch", 90, 6), event("wait for a version", 96, 7), event("load a version", 103, 1),
              event("score", 100, 5, "MainThread"), event("generate a batch", 104, 2), event("generate a batch", 108, 5)]
    metrics = {"time/vllm_generation": 4.0, "time/generation_wait": 2.0}
    shares = runlog.time_shares(metrics, events, 100.0, 110.0)
    assert shares == {"time/update": 10.0, "time/learner_idle_fraction": 0.2, "time/vllm_idle_fraction": 0.5,
                      "time/overlap_bound": 1.5}, shares  # generation: 96-100 outside, 104-106 and 108-110 inside
    assert runlog.time_shares({"time/generation": 1.0}, events, 100.0, 110.0) == {"time/update": 10.0}  # no vLLM
    # Streaming: the generator's "generate" spans (requests in flight) are vLLM's work too: 101-104 and 105-109
    streaming = [event("generate", 95, 6), event("load a version", 101, 0.5), event("generate", 101.5, 2.5),
                 event("wait for a version", 104, 1), event("generate", 105, 4)]
    assert runlog.time_shares(metrics, streaming, 100.0, 110.0)["time/vllm_idle_fraction"] == pytest.approx(0.2)


def test_an_updates_tokens_per_second_from_its_metrics():
    """64 responses of 12.5 tokens on average are 800 tokens. vLLM's engine generated the whole batch in 2 s: 400 a
    second; each of 2 learner processes trained on its 400 in 4 s: 100 a second. Without vLLM each of the 2 processes
    generated its 400 tokens in 0.5 s: 800 a second; an evaluation's row has no tokens."""
    vllm = {"val/response_length": 12.5, "time/vllm_generation": 2.0, "time/training": 4.0}
    assert runlog.throughputs(vllm, 64, 2) == {"time/generated_tokens_per_second": 400.0,
                                               "time/trained_tokens_per_second": 100.0}
    hf = {"val/response_length": 12.5, "time/generation": 0.5, "time/training": 2.0}
    assert runlog.throughputs(hf, 64, 2) == {"time/generated_tokens_per_second": 800.0,
                                             "time/trained_tokens_per_second": 200.0}
    assert runlog.throughputs(hf, 64, 1) == {"time/generated_tokens_per_second": 1600.0,
                                             "time/trained_tokens_per_second": 400.0}
    assert runlog.throughputs({"eval/scores": 0.5, "time/training": 1.0}, 64, 1) == {}
    # online DPO's pairs: 300 of the 800 tokens entered the loss (val/trained_tokens), each process's 150 in 2 s
    assert runlog.throughputs({**hf, "val/trained_tokens": 300.0}, 64, 2)["time/trained_tokens_per_second"] == 75.0


def test_an_updates_tokens_per_second_per_gpu_of_the_run():
    """The GPUs a run uses: a learner process each, and vLLM's where it has its own (distributed.vllm_gpu's placement:
    (its GPU, the training GPU it shares or None)); none on a CPU. Per GPU, an update's 800 tokens (64 responses of
    12.5) in its 2 s of wall clock on 3 GPUs are 800 / 6 a second, 300 trained of them 50; a CPU run logs none."""
    assert runlog.run_gpus(2, True, ("2", None)) == 3  # two learners, vLLM on a GPU of its own
    assert runlog.run_gpus(2, True, ("0", 0)) == 2  # vLLM shares rank 0's GPU
    assert runlog.run_gpus(4, True) == 4  # no vLLM (rloo.py)
    assert runlog.run_gpus(1, False, None) == 0  # a CPU
    update = {"val/response_length": 12.5, "time/update": 2.0, "time/training": 1.0}
    assert runlog.per_gpu_throughputs(update, 64, 3) == {"time/generated_tokens_per_second_per_gpu": 800 / 6,
                                                          "time/trained_tokens_per_second_per_gpu": 800 / 6}
    assert runlog.per_gpu_throughputs({**update, "val/trained_tokens": 300.0}, 64, 3) == {
        "time/generated_tokens_per_second_per_gpu": 800 / 6, "time/trained_tokens_per_second_per_gpu": 50.0}
    assert runlog.per_gpu_throughputs(update, 64, 0) == {}
    assert runlog.per_gpu_throughputs({"eval/scores": 0.5, "time/update": 2.0}, 64, 3) == {}  # an evaluation's row


def fake_run_log(tmp_path, monkeypatch, track=False, batch_size=64):
    """A RunLog of one process (close() gathers only its timeline) writing into `tmp_path`; with `track`, a stand-in
    for wandb that keeps what was logged (wandb.logged); its atexit registrations in `exits`."""
    monkeypatch.setattr(runlog.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(runlog.dist, "get_world_size", lambda: 1)
    monkeypatch.setattr(runlog.dist, "gather_object", lambda events, ranks, dst: ranks.__setitem__(0, events))
    monkeypatch.setattr(timeline, "EVENTS", [])
    exits = []
    monkeypatch.setattr(runlog, "atexit", types.SimpleNamespace(register=exits.append, unregister=exits.remove))
    wandb = types.SimpleNamespace(logged=[], init=lambda **kwargs: None, finish=lambda: None,
                                  run=types.SimpleNamespace(dir=str(tmp_path / "wandb")),
                                  Histogram=lambda np_histogram: ("histogram", np_histogram))
    wandb.log = lambda metrics, step: wandb.logged.append((step, metrics))
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    @dataclasses.dataclass
    class Args:
        num_updates: int = 5
        batch_size: int = 64
        resume: str = None
        track: bool = False
        wandb_project_name: str = "p"
        wandb_entity: str = None

    return runlog.RunLog(Args(batch_size=batch_size, track=track), str(tmp_path), "run", 0, 0), wandb, exits


def test_the_staleness_of_the_batches_so_far_as_a_wandb_histogram(tmp_path, monkeypatch):
    """With --track each update logs async/staleness: every batch trained so far counted at its off-policy steps, one
    bin per whole step (0 for the first batch of a K = 1 run, 1 after), and the update's tokens per second; streaming,
    async/token_staleness too: the update's tokens by staleness (their shares, one bin per version)."""
    log, wandb, _ = fake_run_log(tmp_path, monkeypatch, track=True, batch_size=8)
    assert runlog.staleness_histogram({1: 30, 0: 1}) == ([1, 30], [-0.5, 0.5, 1.5])
    assert runlog.staleness_histogram({2: 5, 0: 1}) == ([1, 0, 5], [-0.5, 0.5, 1.5, 2.5])
    for update, steps in enumerate([0, 1, 1], start=1):
        log.log(update, {**update_metrics(length=4.0), "episode": 8 * update, "async/off_policy_steps": float(steps),
                         "time/vllm_generation": 0.5, "time/training": 2.0, "time/generation_wait": 0.0})
    # streaming: the batch's tokens by staleness, a histogram of this update's alone
    log.log(4, {**update_metrics(length=4.0), "episode": 32, "async/off_policy_steps": 2.0, "time/training": 2.0,
                "time/vllm_generation": 0.5, "time/generation_wait": 0.0, "async/tokens_stale_0": 0.25,
                "async/tokens_stale_1": 0.0, "async/tokens_stale_2": 0.75})
    log.close()
    histograms = [metrics["async/staleness"] for _, metrics in wandb.logged if "async/staleness" in metrics]
    assert histograms == [("histogram", ([1], [-0.5, 0.5])), ("histogram", ([1, 1], [-0.5, 0.5, 1.5])),
                          ("histogram", ([1, 2], [-0.5, 0.5, 1.5])), ("histogram", ([1, 2, 1], [-0.5, 0.5, 1.5, 2.5]))]
    tokens = [metrics["async/token_staleness"] for _, metrics in wandb.logged if "async/token_staleness" in metrics]
    assert tokens == [("histogram", ([0.25, 0.0, 0.75], [-0.5, 0.5, 1.5, 2.5]))]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [(row["time/generated_tokens_per_second"], row["time/trained_tokens_per_second"]) for row in rows] == [
        (64.0, 16.0)] * 4  # 8 responses of 4 tokens: 32 tokens in 0.5 s generating, 2 s training


def test_a_run_that_ends_in_an_error_still_writes_its_trace(tmp_path, monkeypatch):
    """The run log registers, at its start, writing rank 0's timeline at the process's exit; close() writes every rank's
    and takes that back (else the exit would add its phases a second time)."""
    log, _, exits = fake_run_log(tmp_path / "failed", monkeypatch)
    log.log(1, {**update_metrics(), "episode": 64}, phases={"generate": 100.0, "train": 101.0})
    assert not os.path.exists(tmp_path / "failed" / "trace.json")
    for function in exits:  # the run raised: the interpreter's exit runs them
        function()
    spans = [e for e in json.load(open(tmp_path / "failed" / "trace.json"))["traceEvents"] if e["ph"] == "X"]
    assert [(e["name"], e["args"]) for e in spans] == [("generate", {"update": 1}), ("train", {"update": 1})]
    log, _, exits = fake_run_log(tmp_path / "ended", monkeypatch)
    log.log(1, {**update_metrics(), "episode": 64}, phases={"generate": 100.0, "train": 101.0})
    log.close()
    assert exits == [] and len(json.load(open(tmp_path / "ended" / "trace.json"))["traceEvents"]) == 2 + 2
