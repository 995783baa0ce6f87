"""Seeded runs of the twelve scripts in two checkouts, every logged value compared: what a change that should keep
behaviour (a refactor: bit for bit) or change only the arithmetic's rounding (within float tolerance) did to the runs.
Each script runs 4 updates of the tiny task, seed 3, evaluating every 2 updates on 16 prompts (*_vllm.py with
--vllm-enforce-eager), in each checkout; the wall-clock values (time/*) are not compared.

    git worktree add ../before REV && python benchmark/seeded_runs.py ../before . [rloo,ppo,...]
"""

import glob
import json
import os
import subprocess
import sys
import tempfile

SCRIPTS = ["rloo", "ppo", "online_dpo", "bok", "grpo", "tba", "rloo_vllm", "ppo_vllm", "online_dpo_vllm", "bok_vllm",
           "grpo_vllm", "tba_vllm"]


def logged(tree, script, output_dir):
    """The rows of metrics.jsonl of `script`'s seeded run in checkout `tree`."""
    command = [sys.executable, f"{script}.py", "--total-episodes", "256", "--eval-every", "2", "--num-eval-prompts",
               "16", "--seed", "3", "--output-dir", output_dir]
    if script.endswith("_vllm"):
        command.append("--vllm-enforce-eager")
    subprocess.run(command, cwd=tree, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (path,) = glob.glob(os.path.join(output_dir, "*__*", "metrics.jsonl"))
    with open(path) as f:
        return [json.loads(line) for line in f]


def compare(before, after):
    """(values equal bit for bit, {key: (largest absolute difference, largest relative difference)})."""
    equal, moved = 0, {}
    for row_before, row_after in zip(before, after):
        for key, value in row_before.items():
            if key.startswith("time/") or not isinstance(value, (int, float)) or key not in row_after:
                continue
            other = row_after[key]
            if value == other:
                equal += 1
                continue
            absolute = abs(value - other)
            relative = absolute / max(abs(value), abs(other))
            largest = moved.get(key, (0.0, 0.0))
            moved[key] = (max(largest[0], absolute), max(largest[1], relative))
    return equal, moved


def main():
    before_tree, after_tree = sys.argv[1], sys.argv[2]
    scripts = sys.argv[3].split(",") if len(sys.argv) > 3 else SCRIPTS
    with tempfile.TemporaryDirectory() as tmp:
        for script in scripts:
            before = logged(before_tree, script, os.path.join(tmp, "before", script))
            after = logged(after_tree, script, os.path.join(tmp, "after", script))
            equal, moved = compare(before, after)
            largest = sorted(moved.items(), key=lambda item: -item[1][1])[:4]
            print(f"{script}: {len(before)} and {len(after)} rows; {equal} values equal bit for bit, {len(moved)} keys "
                  "move; largest relative: " + ", ".join(f"{key} {relative:.1e} (abs {absolute:.1e})"
                                                         for key, (absolute, relative) in largest), flush=True)


if __name__ == "__main__":
    main()
