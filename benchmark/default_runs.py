"""Each script's default run on the tiny task (64,000 episodes), one after the other: the process's wall clock and,
at every evaluation, the held-out greedy scores with the run's KL and the script's own diagnostic at that update.
docs/results.md's default-run table and each script's "Results on the tiny task" come from this output.

    python benchmark/default_runs.py | tee benchmark/results/default_runs.txt        # about 45 min on 2 cores
    python benchmark/default_runs.py --scripts rloo ppo
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The training metrics printed beside each evaluation: the script's KL, then what its doc's table shows.
DIAGNOSTICS = {"rloo": ["objective/kl"], "online_dpo": ["pairs/kl", "rewards/accuracies"],
               "bok": ["objective/kl", "objective/scores_best"], "ppo": ["objective/kl", "val/explained_variance"],
               "online_dpo_vllm": ["pairs/kl"]}
EVALUATION = ["eval/scores", "eval/gold_scores", "eval/response_length"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scripts", nargs="+", choices=list(DIAGNOSTICS), default=list(DIAGNOSTICS))
    args = parser.parse_args()
    for script in args.scripts:
        with tempfile.TemporaryDirectory() as out:
            started = time.time()
            subprocess.run([sys.executable, f"{script}.py", "--output-dir", out], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            seconds = time.time() - started
            (run,) = os.listdir(out)
            with open(os.path.join(out, run, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
        columns = ["update", "episode", *EVALUATION, *DIAGNOSTICS[script], "time/episodes_per_second"]
        print(f"{script}.py: {seconds:.1f} s in all (the process)")
        print("  " + "  ".join(columns))
        training = {row["update"]: row for row in rows if "time/episodes_per_second" in row}
        for row in rows:
            if "eval/gold_scores" in row or row["update"] == 1:
                row = {**training.get(row["update"], {}), **row}
                print("  " + "  ".join(f"{row[c]:.6g}" if c in row else "-" for c in columns))
        speeds = sorted(row["time/episodes_per_second"] for row in training.values())
        print(f"  episodes per second: median {speeds[len(speeds) // 2]:.0f}, 10th-90th percentile "
              f"{speeds[len(speeds) // 10]:.0f}-{speeds[len(speeds) * 9 // 10]:.0f}")
        if "time/generation_wait" in rows[-1]:  # asynchronous: where an update's time goes, learner and generator
            phases = [key for key in rows[-1] if key.startswith("time/") and key != "time/episodes_per_second"]
            print("  mean seconds per update: " + ", ".join(
                f"{key} {sum(row[key] for row in training.values()) / len(training):.4f}" for key in phases))
        print(flush=True)


if __name__ == "__main__":
    main()
