"""The run log says when a policy collapses (the README's LoRA command once collapsed with no word in its log): every
response empty, the learner's entropy run away, or a KL to the reference of more than a nat a token; once each."""

import json
import os
import types

from conftest import read_metrics, run_dir_of, run_script

import runlog


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


LEARNER = {"rloo_vllm.py": ["take the batch", "score", "train", "hand over", "log"],
           "rloo.py": ["generate", "score", "train", "log"]}


def test_the_trace_shows_every_update_of_the_learner_and_the_generator(tmp_path):
    """trace.json of a short run is a Chrome trace: every update's phases on the learner's track, in a *_vllm.py each
    batch the generator thread generated on its own track, no phase overlapping another on one track, and the phases
    covering at least 90 % of each update's wall-clock time (from one update's first phase to the next's)."""
    for script, phases in LEARNER.items():
        run_script(script, "--total-episodes", "256", "--save-every", "2", "--eval-every", "2", "--num-eval-prompts", "8",
                   *(["--vllm-enforce-eager"] if "vllm" in script else []), "--output-dir", str(tmp_path / script))
        with open(os.path.join(run_dir_of(tmp_path / script), "trace.json")) as f:
            trace = json.load(f)
        names = {(e["pid"], e["tid"]): e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
        spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
        tracks = {name: sorted((e for e in spans if names[(e["pid"], e["tid"])] == name), key=lambda e: e["ts"])
                  for name in set(names.values())}
        learner = tracks["MainThread"]
        for update in range(1, 5):
            assert [e["name"] for e in learner if e["args"].get("update") == update and e["name"] in phases] == phases
        if "vllm" in script:
            assert [e["args"]["update"] for e in tracks["generator"] if e["name"] == "generate a batch"] == [1, 2, 3, 4]
        assert {e["name"] for e in learner} - set(phases) == {"checkpoint", "wait for the batches ahead"} & {
            e["name"] for e in learner}
        for track in tracks.values():
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1 for a, b in zip(track, track[1:])), track  # (1 us: rounding)
        rows = [row for row in read_metrics(run_dir_of(tmp_path / script)) if row["update"]]
        assert all(row["time/update"] > 0 for row in rows)
        if "vllm" in script:  # where each update's time went
            assert all(0 <= row["time/learner_idle_fraction"] <= 1 and 0 <= row["time/vllm_idle_fraction"] <= 1
                       and 1 <= row["time/overlap_bound"] <= 2 for row in rows), rows
        starts = [e["ts"] for e in learner if e["name"] == phases[0]]
        for start, end in zip(starts, starts[1:]):
            covered = sum(e["dur"] for e in learner if start <= e["ts"] < end)
            assert covered >= 0.9 * (end - start), (script, start, end, covered)


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
