"""grpo.py's five loss types on the tiny task at the learning test's settings (learning rate 1e-4, 100 updates of 16
prompts x 4), each with its paper's defaults, at one optimizer step a batch (the default: the ratio stays 1, no clip
acts) and at four mini-batches of 16 prompts' responses (four steps a batch, as GSPO's paper ran it: the ratio moves
and the clips act). For each run: greedy answers to 256 held-out prompts, proxy and gold scores and objective/kl at
updates 0, 50 and 100, and the mean share of clipped tokens. docs/grpo.md's loss-type table comes from this output.

    python benchmark/grpo_loss_types.py | tee benchmark/results/grpo_loss_types_tiny.txt    # about 8 min on 2 cores
"""

import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOSS_TYPES = ["grpo", "dr_grpo", "dapo", "gspo", "cispo"]
SCHEDULES = {1: [], 4: ["--num-mini-batches", "4", "--per-device-train-batch-size", "16"]}


def main():
    common = ["--learning-rate", "1e-4", "--total-episodes", "6400", "--eval-every", "50"]
    print(f"# python grpo.py --loss-type X {' '.join(common)} [--num-mini-batches 4 --per-device-train-batch-size 16];"
          " update: proxy, gold, objective/kl at that update (0 before training)", flush=True)
    for mini_batches, schedule in SCHEDULES.items():
        for loss_type in LOSS_TYPES:
            with tempfile.TemporaryDirectory() as out:
                started = time.time()
                subprocess.run([sys.executable, "grpo.py", "--loss-type", loss_type, *common, *schedule,
                                "--output-dir", out], cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
                seconds = time.time() - started
                (run,) = os.listdir(out)
                with open(os.path.join(out, run, "metrics.jsonl")) as f:
                    rows = {row["update"]: row for row in map(json.loads, f)}
            points = "; ".join(f"{u}: {rows[u]['eval/scores']:.3f}, {rows[u]['eval/gold_scores']:.3f}, "
                               f"{rows[u].get('objective/kl', 0.0):.2f}" for u in (0, 50, 100))
            clipped = sum(rows[u]["policy/clipfrac_avg"] for u in range(1, 101)) / 100
            print(f"--loss-type {loss_type}, mini-batches {mini_batches}: {points}; clipped {clipped:.4f}; "
                  f"{seconds:.0f} s", flush=True)


if __name__ == "__main__":
    main()
