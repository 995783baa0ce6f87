"""The weight hand-off against an update: `online_dpo_vllm.py --vllm-enforce-eager` on the tiny task, 100 updates, once
with `--weight-sync memory` (on a CPU through the tests' vLLM plugin, tests/cpu_weight_transfer) and once with
`--weight-sync file`. Prints each run's mean seconds per update of the learner's side of the hand-off
(`time/weight_sync`) and of its scoring and training, the hand-off's share of that, and whether the two runs logged
the same metrics at every update (the timings aside). docs/performance.md's "Against an update" comes from it.

    python benchmark/handoff_per_update.py | tee benchmark/results/handoff_per_update.txt     # about 6 min on 2 cores
"""

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLUGIN = os.path.join(ROOT, "tests", "cpu_weight_transfer")


def run(weight_sync):
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [PLUGIN, os.environ.get("PYTHONPATH")]))}
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, "online_dpo_vllm.py", "--vllm-enforce-eager", "--weight-sync", weight_sync,
                        "--total-episodes", "6400", "--output-dir", out], cwd=ROOT, env=environment, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        (name,) = os.listdir(out)
        with open(os.path.join(out, name, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f]


def main():
    learned = {}
    for weight_sync in ["memory", "file"]:
        rows = run(weight_sync)
        updates = [row for row in rows if "time/weight_sync" in row]
        handoff = sum(row["time/weight_sync"] for row in updates) / len(updates)
        update = sum(row["time/scoring"] + row["time/training"] for row in updates) / len(updates)
        print(f"--weight-sync {weight_sync}: {len(updates)} updates; per update (mean) the learner's hand-off "
              f"{handoff * 1000:.2f} ms, scoring + training {update:.4f} s; the hand-off is {handoff / update:.1%} of it")
        learned[weight_sync] = [{key: value for key, value in row.items() if not key.startswith("time/")}
                                for row in rows]
    differ = sorted({key for a, b in zip(learned["memory"], learned["file"]) for key in a.keys() | b.keys()
                     if a.get(key) != b.get(key)})
    print(f"the two runs log the same metrics at every update (timings aside): {not differ}"
          + (f"; they differ in {', '.join(differ)}" if differ else ""))


if __name__ == "__main__":
    main()
