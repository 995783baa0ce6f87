"""Streaming generation on a real model, learning and resumed: for each *_vllm.py script, a --generation streaming run
on SmolLM2-135M-Instruct's one-digit sums (async_speedup.py's --task smollm2 settings) evaluated greedily on the 96
test problems at its start, its checkpoint and its end, then a second run resumed from that checkpoint to the end.
Prints the accuracies and a verdict, what the checkpoint kept and what the resumed run generated again, and checks
(each line ok or FAILED; exit code 1 if any failed):

- every prompt the script's order drew was trained on once or is still drawn and untrained at the end (the run's
  batches up to the checkpoint and the resumed run's after it, against batch_prompts(): none lost, none twice),
  and likewise in the run never stopped;
- the resumed run's updates and episodes go on from the checkpoint's;
- the weight check (--check-weights-every 2) held at every version it was due, in both runs;
- no token was trained on by a policy more than K (--off-policy-steps) versions newer than the one that sampled it.

Each run goes through this file (--record-batches), which runs the script unchanged and records, from
generator.AsyncGeneration, each batch's prompts and token versions, each weight check, and where the checkpoint's
untrained prompts were (in flight, finished) when it was written.

    python benchmark/streaming_smollm2.py                          # grpo_vllm, ppo_vllm: 8 updates, resumed at 4
    python benchmark/streaming_smollm2.py --scripts ppo_vllm --updates 6 --resume-at 3   # 14 minutes on 2 cores
    python benchmark/streaming_smollm2.py --scripts rloo_vllm --keep DIR

A learner takes 6-8 GB (a resumed PPO one up to 13 GB at its last update, killed there beside other jobs:
benchmark/results/streaming_smollm2.txt); vLLM's engine 2.5 GB more.

Any other argument is passed to every run. With --keep DIR each run's metrics.jsonl, trace.json, command.json and
batches.jsonl stay in DIR/<script>/<whole|resumed>/.
"""

import argparse
import collections
import importlib
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["grpo_vllm", "ppo_vllm", "rloo_vllm"]
RISES = 0.10  # a gain this large is about two standard errors of one evaluation on 96 problems (p near 0.5)


def say(text):
    """Print `text` in lines of at most 120 characters."""
    print(textwrap.fill(text, 120, subsequent_indent="    ", break_long_words=False, break_on_hyphens=False),
          flush=True)


def record_batches(path, script, arguments):
    """Run `script` with `arguments` as its command line, appending to `path` (JSON lines) what rank 0's
    AsyncGeneration gives the learner (each batch's prompts and token versions), each weight check that held, and at
    each checkpoint where its drawn-but-untrained prompts were."""
    sys.path.insert(0, ROOT)
    import generator

    def write(record):
        with open(path, "a") as f:
            f.write(json.dumps(record) + "\n")

    get, checkpoint_files, check = (generator.AsyncGeneration.get, generator.AsyncGeneration.checkpoint_files,
                                    generator.check_vllm_weights)

    def recorded_get(self):
        batch = get(self)
        if self.rank == 0:
            write({"update": self.update, "prompts": batch.prompts, "token_versions": batch.token_versions,
                   "train_prompts": len(self.thread.train_prompts), "per_rank": self.thread.prompts_per_rank})
        return batch

    def recorded_checkpoint_files(self, update):
        files = checkpoint_files(self, update)
        if self.rank == 0:
            thread = self.thread  # (its generator thread goes on: a group may move while it is counted)
            queued = [group for batch in list(thread.batches.queue) for group in batch.stream["groups"]]
            running = {group: sum(s is not None for s in thread.samples.get(group, [])) for group in thread.running}
            write({"checkpoint": update, "state": files[generator.STREAM_STATE], "in_flight": len(running),
                   "in_flight_finished_responses": sum(running.values()), "finished": len(thread.done),
                   "in_a_batch": len(queued), "to_generate_again": len(thread.again), "k": thread.k})
        return files

    def recorded_check(llm, version, *args, **kwargs):
        result = check(llm, version, *args, **kwargs)  # raises if vLLM's weights differ: the run stops
        write({"weight_check": version})
        return result

    generator.AsyncGeneration.get = recorded_get
    generator.AsyncGeneration.checkpoint_files = recorded_checkpoint_files
    generator.check_vllm_weights = recorded_check
    sys.argv = [script, *arguments]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


def run(script, arguments, output_dir, record, keep=None, run_dir=None):
    """One run of `script` through record_batches() (resumed: in `run_dir`, its checkpoint's); returns (its run
    directory, seconds)."""
    command = [sys.executable, os.path.abspath(__file__), "--record-batches", record, f"{script}.py", *arguments,
               "--output-dir", output_dir]
    started = time.time()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    seconds = time.time() - started
    if result.returncode != 0:
        sys.exit(f"{script}.py failed (exit code {result.returncode}):\n{result.stderr[-3000:]}")
    if run_dir is None:
        (run_name,) = os.listdir(output_dir)
        run_dir = os.path.join(output_dir, run_name)
    if keep:
        os.makedirs(keep, exist_ok=True)
        for name in ("metrics.jsonl", "trace.json"):
            shutil.copy(os.path.join(run_dir, name), keep)
        shutil.copy(record, os.path.join(keep, "batches.jsonl"))
        with open(os.path.join(keep, "command.json"), "w") as f:
            json.dump(["python", f"{script}.py", *arguments], f)
    return run_dir, seconds


def read_jsonl(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def drawn_prompts(script_module, seed, train_prompts, per_rank, state):
    """The prompts the script's order (batch_prompts, batch 1 on) had drawn when the generator's state was taken."""
    args = types.SimpleNamespace(seed=seed, world_size=1)
    order = [i for batch in range(1, state["next_batch"] + 1)
             for indices in script_module.batch_prompts(args, train_prompts, per_rank, batch) for i in indices]
    return order[:(state["next_batch"] - 1) * per_rank + state["next_in_batch"]]


def once_each(trained, untrained, drawn):
    """(lost, trained twice) against the order: prompts drawn neither trained nor untrained, and those trained or
    untrained more often than drawn (multisets: a second epoch draws a prompt again)."""
    have, want = collections.Counter(trained) + collections.Counter(untrained), collections.Counter(drawn)
    return sum((want - have).values()), sum((have - want).values())


def report(script, options, extra, tmp, checks):
    """The two runs of `script` and their checks; appends (ok, line) to `checks`."""
    from async_speedup import SMOLLM2  # (this script's folder)

    settings = list(SMOLLM2)
    for name in ["--eval-every"] + (["--k"] if script.startswith("ppo") else []):  # (PPO samples one response a
        i = settings.index(name)  # prompt: it has no --k)
        settings = settings[:i] + settings[i + 2:]
    k, updates, at = options.off_policy_steps, options.updates, options.resume_at
    arguments = [*settings, "--generation", "streaming", "--off-policy-steps", str(k), "--seed", str(options.seed),
                 "--total-episodes", str(32 * updates), "--eval-every", str(at), "--save-every", str(at),
                 "--check-weights-every", "2", *extra]
    keep = {part: options.keep and os.path.join(options.keep, script, part) for part in ("whole", "resumed")}
    print()
    say(f"{script}.py {' '.join(arguments)}")

    # The run, never stopped: it saves checkpoint-<at> and checkpoint-<updates>.
    whole_record = os.path.join(tmp, f"{script}-whole.jsonl")
    run_dir, whole_seconds = run(script, arguments, os.path.join(tmp, script, "whole"), whole_record, keep["whole"])
    # The resumed run: the run directory as a kill after checkpoint-<at> left it, resumed from that checkpoint.
    resumed_dir = os.path.join(tmp, script, "resumed", os.path.basename(run_dir))
    shutil.copytree(run_dir, resumed_dir, ignore=shutil.ignore_patterns(f"checkpoint-{updates}"))
    with open(os.path.join(resumed_dir, "metrics.jsonl")) as f:  # (the resumed run drops the rows after <at>)
        whole_rows = [json.loads(line) for line in f]
    resumed_record = os.path.join(tmp, f"{script}-resumed.jsonl")
    _, resumed_seconds = run(script, [*arguments, "--resume", os.path.join(resumed_dir, f"checkpoint-{at}")],
                             os.path.join(tmp, script, "whole"), resumed_record, keep["resumed"], resumed_dir)
    resumed_rows = read_jsonl(os.path.join(resumed_dir, "metrics.jsonl"))

    # Held-out greedy accuracy (the rule reward's mean: eval/scores).
    evals = {row["update"]: row["eval/scores"] for row in whole_rows if "eval/scores" in row}
    gain = evals[updates] - evals[0]
    verdict = (f"rises by {gain:+.3f}" if gain >= RISES else f"does not rise by {RISES} or more ({gain:+.3f})")
    say("held-out greedy accuracy on 96 test problems: " + ", ".join(f"update {u} {s:.3f}" for u, s in evals.items())
          + f"; the resumed run's at update {updates}: {resumed_rows[-1]['eval/scores']:.3f}")
    say(f"verdict: accuracy {verdict} in {updates} updates (a rise is {RISES} or more, about two standard errors of "
          "one evaluation on 96 problems)")
    say(f"wall clock: the run {whole_seconds:.0f} s, the resumed run {resumed_seconds:.0f} s (start-up included)")
    for name, rows in (("run", whole_rows), ("resumed run", resumed_rows)):
        tail = [row for row in rows if row["update"] > (at if name == "resumed run" else 0)]
        say(f"{name}, updates {tail[0]['update']}-{tail[-1]['update']}: token staleness max "
              f"{[int(row['async/token_staleness_max']) for row in tail]}, mean "
              f"{[round(row['async/token_staleness_mean'], 2) for row in tail]}, mixed-version responses "
              f"{[round(row['async/mixed_version_responses'], 3) for row in tail]}, prompts generated again "
              f"{[int(row['async/regenerated_prompts']) for row in tail]}, mismatch KL "
              + str([float(f"{row['async/mismatch_kl']:.1e}") for row in tail]))

    module = importlib.import_module(script)
    whole, resumed = read_jsonl(whole_record), read_jsonl(resumed_record)
    batches = {name: [r for r in records if "prompts" in r] for name, records in (("whole", whole),
                                                                                 ("resumed", resumed))}
    first = batches["whole"][0]
    n, per_rank = first["train_prompts"], first["per_rank"]
    (saved,) = [r for r in whole if r.get("checkpoint") == at]
    untrained, group = saved["state"]["untrained"], "k responses" if saved["k"] > 1 else "its response"
    moving = len(untrained) - saved["in_flight"] - saved["finished"] - saved["in_a_batch"] - saved["to_generate_again"]
    say(f"checkpoint-{at}: the run had drawn {len(untrained) + at * per_rank} prompts from the order and trained on "
          f"{at * per_rank}; of the {len(untrained)} drawn and not trained on, {saved['in_flight']} were in flight "
          f"({saved['in_flight_finished_responses']} of their {saved['in_flight'] * saved['k']} responses finished), "
          f"{saved['finished']} finished ({group}) waiting for a batch, {saved['in_a_batch']} in batches generated "
          f"but not taken, {saved['to_generate_again']} waiting to be generated again"
          + (f", {moving} moved while counted" if moving else "") + ". The checkpoint (stream.json) keeps these "
          "prompts, not their responses: the resumed run generates every one again, finished ones included, "
          "from its own policy (version "
          f"{at}), before the order's next prompts; it keeps none of the responses generated before the checkpoint.")
    again = collections.Counter(untrained)
    where = sorted({b["update"] for b in batches["resumed"] for i in b["prompts"][0] if i in again})
    say(f"the resumed run trained the checkpoint's untrained prompts in its updates {where}")

    ends = {"whole": [r for r in whole if r.get("checkpoint") == updates][-1]["state"],
            "resumed": [r for r in resumed if r.get("checkpoint") == updates][-1]["state"]}
    trained = {"whole": [i for b in batches["whole"] for i in b["prompts"][0]],
               "resumed": [i for b in batches["whole"] if b["update"] <= at for i in b["prompts"][0]]
               + [i for b in batches["resumed"] for i in b["prompts"][0]]}
    for name, what in (("whole", "the run never stopped"), ("resumed", f"the run to {at}, then the resumed run")):
        drawn = drawn_prompts(module, options.seed, n, per_rank, ends[name])
        lost, twice = once_each(trained[name], ends[name]["untrained"], drawn)
        checks.append((lost == twice == 0, f"{script} {what}: {len(drawn)} prompts drawn in the order, "
                       f"{len(trained[name])} trained, {len(ends[name]['untrained'])} untrained at the end; lost "
                       f"{lost}, trained twice {twice}"))
    later = collections.Counter(i for b in batches["whole"] if b["update"] > at for i in b["prompts"][0])
    same = sum((later & collections.Counter(i for b in batches["resumed"] for i in b["prompts"][0])).values())
    say(f"updates {at + 1}-{updates}: the resumed run trained {same} of the {sum(later.values())} prompts the run "
          "never stopped trained there (vLLM's timing decides which responses finish first)")

    numbered = [row["update"] for row in resumed_rows]
    episodes = [row["episode"] for row in resumed_rows]
    checks.append((numbered == list(range(updates + 1)) and [b["update"] for b in batches["resumed"]]
                   == list(range(at + 1, updates + 1)) and episodes[-1] == whole_rows[-1]["episode"]
                   and episodes[at + 1] == episodes[at] + 32,
                   f"{script} resumed: updates {numbered[at + 1:]} after the checkpoint's {at}, episodes "
                   f"{episodes[at]} -> {episodes[-1]} (the run never stopped: {whole_rows[-1]['episode']})"))
    # due at the start, then at the hand-off of the first version and every second one (none after the last update)
    due = {name: [first] + sorted(u for u in {first + 1} | set(range(first + 2 - first % 2, updates, 2)) if u < updates)
           for name, first in (("whole", 0), ("resumed", at))}
    for name, records in (("whole", whole), ("resumed", resumed)):
        held = [r["weight_check"] for r in records if "weight_check" in r]
        checks.append((held == due[name], f"{script} {name}: weight checks held at versions {held} (due: {due[name]})"))
    staleness = {name: max(b["update"] - 1 - v for b in batches[name] for rank in b["token_versions"]
                           for response in rank for v in response) for name in batches}
    logged = max(row["async/token_staleness_max"] for row in whole_rows[1:] + resumed_rows[at + 1:])
    checks.append((max(staleness.values()) <= k and logged <= k,
                   f"{script}: largest token staleness {staleness['whole']} (run), {staleness['resumed']} (resumed), "
                   f"logged {logged:.0f}; K = {k}"))


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--record-batches":
        return record_batches(*sys.argv[2:4], sys.argv[4:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=SCRIPTS[:2], choices=SCRIPTS)
    parser.add_argument("--updates", type=int, default=8, help="updates of 32 responses in each run")
    parser.add_argument("--resume-at", type=int, default=4, help="the checkpoint the second run resumes from")
    parser.add_argument("--off-policy-steps", type=int, default=1, help="K: every token's largest staleness")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--keep", default="", help="a directory to keep each run's small files in")
    options, extra = parser.parse_known_args()
    sys.path.insert(0, ROOT)
    from smollm2_sync_mismatch import start  # (this script's folder)
    start()
    checks = []
    with tempfile.TemporaryDirectory() as tmp:
        for script in options.scripts:
            report(script, options, extra, tmp, checks)
    print()
    for ok, line in checks:
        say(f"{'ok    ' if ok else 'FAILED'} {line}")
    sys.exit(0 if all(ok for ok, _ in checks) else 1)


if __name__ == "__main__":
    main()
