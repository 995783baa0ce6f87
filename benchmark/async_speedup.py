"""Asynchronous against synchronous online DPO on the tiny task, measured in one invocation.

Runs `online_dpo_vllm.py --sync` and `online_dpo_vllm.py` (asynchronous, K policies late) for the
same number of episodes, one after the other, and prints for each: the training loop's wall clock
(from the first update to the last, without start-up), episodes per second, the share of that time
the learner spent waiting for generation, and the final proxy and gold scores of greedy answers
to held-out prompts; then the asynchronous run's speed-up.

    python benchmark/async_speedup.py                      # 200 updates each, about 5 minutes on 2 CPU cores
    python benchmark/async_speedup.py --total-episodes 64000 --off-policy-steps 2

Any other argument is passed to both runs (for example --learning-rate 1e-4).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(mode_arguments, total_episodes, extra, output_dir):
    command = [sys.executable, "online_dpo_vllm.py", *mode_arguments, "--total-episodes", str(total_episodes),
               "--eval-every", "0", "--output-dir", output_dir, *extra]
    started = time.time()
    subprocess.run(command, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    process_seconds = time.time() - started
    (run_name,) = os.listdir(output_dir)
    with open(os.path.join(output_dir, run_name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    updates, last = rows[1:], rows[-1]
    loop_seconds = last["episode"] / last["time/episodes_per_second"]  # it counts from the first update to the last
    return {
        "loop seconds": loop_seconds,
        "process seconds": process_seconds,
        "episodes/s": last["time/episodes_per_second"],
        "learner idle": sum(row["time/generation_wait"] for row in updates) / loop_seconds,
        "off-policy steps": sum(row["async/off_policy_steps"] for row in updates) / len(updates),
        "proxy score": last["eval/scores"],
        "gold score": last["eval/gold_scores"],
        "start proxy": rows[0]["eval/scores"],
        "start gold": rows[0]["eval/gold_scores"],
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--total-episodes", type=int, default=12800, help="episodes of each run (default 200 updates)")
    parser.add_argument("--off-policy-steps", type=int, default=1, help="K of the asynchronous run")
    options, extra = parser.parse_known_args()

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, mode in (("sync", ["--sync"]), ("async", ["--off-policy-steps", str(options.off_policy_steps)])):
            print(f"running {name} ...", flush=True)
            results[name] = run(mode, options.total_episodes, extra, os.path.join(tmp, name))

    columns = ["loop seconds", "process seconds", "episodes/s", "learner idle", "off-policy steps", "start proxy",
               "proxy score", "start gold", "gold score"]
    print(f"\nonline_dpo_vllm.py, {options.total_episodes} episodes, async K = {options.off_policy_steps}"
          f"{' ' + ' '.join(extra) if extra else ''}")
    print(f"{'':8}" + "".join(f"{c:>16}" for c in columns))
    for name, result in results.items():
        print(f"{name:8}" + "".join(f"{result[c]:>16.3f}" for c in columns))
    speedup = results["sync"]["loop seconds"] / results["async"]["loop seconds"]
    print(f"\nasync speed-up (sync loop time / async loop time): {speedup:.2f}x")


if __name__ == "__main__":
    main()
