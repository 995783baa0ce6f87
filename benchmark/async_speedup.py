"""Asynchronous against synchronous generation for every *_vllm.py script, measured in one invocation.

For each script, runs it with `--sync` and asynchronously (K policies late) for the same number of
episodes, one after the other (`--modes` adds streaming generation, or picks), and prints for each run: the
training loop's wall clock (from the first update to the last, without start-up), episodes and response tokens
trained on per second, the share of that time the learner spent waiting for generation (idle) and vLLM's idle
share, the mean off-policy steps, and the proxy and gold scores of greedy answers to held-out prompts at the start
and the end; then each script's speed-up.
With `--task math` (the math task, assets/tiny_math, scored by the last-number rule) the scores are
greedy test accuracy, evaluated every 20 updates, and it also prints both accuracy curves against the
loop's wall clock and when each first reached the `--sync` run's final accuracy (the paper's
comparison: the time to equal accuracy). `--task smollm2` does the same with a real pretrained chat model,
SmolLM2-135M-Instruct, on one-digit sums (assets/make_smollm2.py builds both; docs/results.md), with the
settings that learn there (SMOLLM2 below). With several `--seeds` the tables and curves are means over
seeds (one seed's accuracy on the 288 test problems moves by about 0.025 between evaluations).

    python benchmark/async_speedup.py                      # 5 scripts x 200 updates x 2 modes, about 20 minutes on 2 CPU cores
    python benchmark/async_speedup.py --task math --scripts rloo_vllm online_dpo_vllm --seeds 1 2 3   # about 20 minutes
    python benchmark/async_speedup.py --task math --scripts rloo_vllm online_dpo_vllm --seeds 1 2 3 \
        --total-episodes 25600 --async-total-episodes 32000 --learning-rate 1e-4   # to the plateau, 31 minutes
    python benchmark/async_speedup.py --scripts online_dpo_vllm --total-episodes 64000 --off-policy-steps 2
    python benchmark/async_speedup.py --task smollm2 --scripts rloo_vllm --total-episodes 320   # a real model, 16 minutes
    python benchmark/async_speedup.py --task smollm2 --scripts online_dpo_vllm --total-episodes 320 --learning-rate 3e-6
    python benchmark/async_speedup.py --task smollm2 --scripts ppo_vllm bok_vllm grpo_vllm --total-episodes 320 --seeds 1 2

Any other argument is passed to every run (for example --learning-rate 1e-4). With --keep DIR each run's
metrics.jsonl, trace.json and command (command.json) stay in DIR/<script>/<mode>/<run name>/, for
benchmark/plot.py (the README's figure: benchmark/results/readme_async_math.txt says how).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["online_dpo_vllm", "rloo_vllm", "ppo_vllm", "bok_vllm", "grpo_vllm", "tba_vllm"]
COLUMNS = ["loop seconds", "process seconds", "episodes/s", "tokens/s", "learner idle", "vLLM idle",
           "off-policy steps", "start proxy", "proxy score", "start gold", "gold score"]
MATH_COLUMNS = COLUMNS[:7] + ["start accuracy", "accuracy"]
MATH = ["--sft-model-path", "assets/tiny_math/sft", "--dataset-name", "assets/tiny_math/data", "--rule-reward",
        "last_number", "--response-length", "8", "--max-prompt-length", "48", "--learning-rate", "3e-4",
        "--num-eval-prompts", "288", "--eval-every", "20"]
SMOLLM2 = ["--sft-model-path", "assets/smollm2/model", "--dataset-name", "assets/smollm2/data", "--rule-reward",
           "last_number", "--response-length", "16", "--max-prompt-length", "64", "--k", "4",
           "--per-device-train-batch-size", "32", "--learning-rate", "1e-5", "--missing-eos-penalty", "0",
           "--num-eval-prompts", "96", "--eval-every", "5"]


def run(script, mode_arguments, total_episodes, extra, output_dir, keep=None):
    if script.startswith("ppo") and "--k" in extra:  # PPO samples one response per prompt: it has no --k
        i = extra.index("--k")
        extra = extra[:i] + extra[i + 2:]
    command = [sys.executable, f"{script}.py", *mode_arguments, "--total-episodes", str(total_episodes),
               "--eval-every", "0", "--output-dir", output_dir, *extra]  # a later --eval-every in extra wins
    started = time.time()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process_seconds = time.time() - started
    (run_name,) = os.listdir(output_dir)
    if keep:  # the small files benchmark/plot.py reads, and the command that made them (no checkpoints)
        kept = os.path.join(keep, run_name)
        os.makedirs(kept, exist_ok=True)
        for name in ("metrics.jsonl", "trace.json"):
            shutil.copy(os.path.join(output_dir, run_name, name), kept)
        with open(os.path.join(kept, "command.json"), "w") as f:
            json.dump(["python", *command[1:]], f)
    with open(os.path.join(output_dir, run_name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    updates, last = [row for row in rows[1:] if "time/update" in row], rows[-1]
    loop_seconds = last["episode"] / last["time/episodes_per_second"]  # it counts from the first update to the last
    update_seconds = sum(row["time/update"] for row in updates)
    # (loop seconds when the update ended, its evaluation's score): evaluations before it are inside those seconds
    curve = [(row["episode"] / row["time/episodes_per_second"] if row["update"] else 0.0, row["eval/scores"])
             for row in rows if "eval/scores" in row]
    return {
        "curve": curve,
        "loop seconds": loop_seconds,
        "process seconds": process_seconds,
        "episodes/s": last["time/episodes_per_second"],
        # the response tokens trained on (val/trained_tokens where a script logs it, else every response's)
        "tokens/s": sum(row.get("val/trained_tokens", row["val/response_length"] * (row["episode"] - before["episode"]))
                        for before, row in zip(rows, rows[1:]) if "time/update" in row) / loop_seconds,
        "learner idle": sum(row["time/generation_wait"] for row in updates) / loop_seconds,
        "vLLM idle": sum(row["time/vllm_idle_fraction"] * row["time/update"] for row in updates) / update_seconds,
        "off-policy steps": sum(row["async/off_policy_steps"] for row in updates) / len(updates),
        "proxy score": last["eval/scores"],
        "gold score": last.get("eval/gold_scores", float("nan")),
        "start proxy": rows[0]["eval/scores"],
        "start gold": rows[0].get("eval/gold_scores", float("nan")),
        "accuracy": last["eval/scores"],
        "start accuracy": rows[0]["eval/scores"],
    }


def mean_of(runs):
    """The runs' mean of every column, and their mean curve (the same updates are evaluated in every run)."""
    mean = {column: sum(run[column] for run in runs) / len(runs) for column in runs[0] if column != "curve"}
    mean["curve"] = [tuple(sum(values) / len(runs) for values in zip(*points)) for points in
                     zip(*(run["curve"] for run in runs))]
    return mean


def first_time_at(curve, target):
    """Loop seconds of the first evaluation scoring at least `target` (None if none did)."""
    return next((seconds for seconds, score in curve if score >= target - 1e-9), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scripts", nargs="+", default=SCRIPTS, choices=SCRIPTS, help="scripts to compare")
    parser.add_argument("--total-episodes", type=int, default=12800, help="episodes of each run (default 200 updates)")
    parser.add_argument("--off-policy-steps", type=int, default=1, help="K of the asynchronous runs")
    parser.add_argument("--modes", nargs="+", default=["sync", "async"], choices=["sync", "async", "streaming"],
                        help="the runs of each script, in this order: --sync, asynchronous (--generation batch, K late), "
                             "streaming (--generation streaming, K the bound on each token's staleness)")
    parser.add_argument("--async-total-episodes", type=int, default=0,
                        help="episodes of the asynchronous runs, if more (to time them to the sync run's final accuracy)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1], help="seeds of each mode; the tables average them")
    parser.add_argument("--keep", default="",
                        help="a directory to keep each run's metrics.jsonl, trace.json and command in, as "
                             "KEEP/<script>/<mode>/<run name>/ (benchmark/plot.py's input)")
    parser.add_argument("--task", choices=["tiny", "math", "smollm2"], default="tiny",
                        help="tiny: the TL;DR miniature (reward models); math: assets/tiny_math with the rule reward; "
                             "smollm2: SmolLM2-135M-Instruct on one-digit sums (assets/make_smollm2.py)")
    options, extra = parser.parse_known_args()
    columns = COLUMNS if options.task == "tiny" else MATH_COLUMNS
    extra = {"tiny": [], "math": MATH, "smollm2": SMOLLM2}[options.task] + extra
    if options.task == "smollm2":
        from smollm2_sync_mismatch import build_smollm2  # (this script's folder)
        build_smollm2()

    speedups = {}
    with tempfile.TemporaryDirectory() as tmp:
        for script in options.scripts:
            results = {}
            late = ["--off-policy-steps", str(options.off_policy_steps)]
            modes = {"sync": ["--sync"], "async": late, "streaming": ["--generation", "streaming", *late]}
            for name in options.modes:
                mode, runs = modes[name], []
                for seed in options.seeds:
                    print(f"running {script} {name} seed {seed} ...", flush=True)
                    episodes = options.async_total_episodes if name != "sync" else 0
                    keep = options.keep and os.path.join(options.keep, script, name)
                    runs.append(run(script, [*mode, "--seed", str(seed)], episodes or options.total_episodes, extra,
                                    os.path.join(tmp, script, f"{name}-{seed}"), keep))
                results[name] = mean_of(runs)
                if len(runs) > 1:
                    print(f"{name} final scores by seed: " + ", ".join(f"{r['proxy score']:.3f}" for r in runs))
            print(f"\n{script}.py, {options.total_episodes} episodes (async {options.async_total_episodes or 'the same'}), "
                  f"async K = {options.off_policy_steps}, "
                  f"mean of seeds {options.seeds}{' ' + ' '.join(extra) if extra else ''}")
            print(f"{'':8}" + "".join(f"{c:>17}" for c in columns))
            for name, result in results.items():
                print(f"{name:8}" + "".join(f"{result[c]:>17.3f}" for c in columns))
            faster = [name for name in results if name != "sync"] if "sync" in results else []
            for name in faster:
                speedups[f"{script} {name}"] = results[name]["episodes/s"] / results["sync"]["episodes/s"]
                print(f"{name} speed-up ({name} episodes/s / sync episodes/s; at equal episodes, sync loop time / "
                      f"{name} loop time): {speedups[f'{script} {name}']:.2f}x", flush=True)
            if options.task != "tiny":
                for name, result in results.items():
                    print(f"{name:6} accuracy against loop seconds: "
                          + " ".join(f"{seconds:.1f}s:{score:.3f}" for seconds, score in result["curve"]))
                finals = {name: result["accuracy"] for name, result in results.items()}
                targets = [("the lower final accuracy (equal accuracy)", min(finals.values()))]
                if "sync" in finals:
                    targets.insert(0, ("the sync run's final accuracy", finals["sync"]))
                for what, target in targets:
                    reached = {name: first_time_at(result["curve"], target) for name, result in results.items()}
                    print(f"first at {what}, {target:.3f}: " + ", ".join(
                        f"{name} {'never' if t is None else f'{t:.1f} s'}" for name, t in reached.items())
                          + "".join(f" ({name} {reached['sync'] / reached[name]:.2f}x sooner)" for name in faster
                                    if reached["sync"] is not None and reached[name]))
            print(flush=True)
    print("speed-ups: " + ", ".join(f"{run} {speedup:.2f}x" for run, speedup in speedups.items()))


if __name__ == "__main__":
    main()
