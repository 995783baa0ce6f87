"""Where a script's updates spend their time, by operator: the script runs as `python SCRIPT ARGS` would, under
PyTorch's profiler (this process's operators: the learner's; a *_vllm.py's engine runs in a process of its own), and
the operators taking the most time of the whole run are printed with their share, beside the run's phases per update
(its time/* metrics, the first two updates left out as warm-up).

    python benchmark/profile_update.py rloo.py --sft-model-path assets/smollm2/model --dataset-name assets/smollm2/data \\
        --rule-reward last_number --k 4 --max-prompt-length 64 --missing-eos-penalty 0 --learning-rate 3e-6 \\
        --response-length 16 --per-device-train-batch-size 32 --total-episodes 192 --eval-every 0 --no-bf16
"""

import glob
import json
import os
import runpy
import statistics
import sys
import tempfile

from torch.profiler import ProfilerActivity, profile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    script, arguments = sys.argv[1], sys.argv[2:]
    output_dir = tempfile.mkdtemp()
    sys.argv = [script, *arguments, "--output-dir", output_dir]
    sys.path.insert(0, ROOT)
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        except SystemExit as error:
            if error.code:
                raise
    (metrics,) = glob.glob(os.path.join(output_dir, "*__*", "metrics.jsonl"))
    with open(metrics) as f:
        rows = [row for row in map(json.loads, f) if row.get("update", 0) > 2 and "time/training" in row]
    phases = sorted({key for row in rows for key in row if key.startswith("time/") and key != "time/episodes_per_second"})
    print(f"{script}: median seconds per update over updates 3-{len(rows) + 2}")
    print(", ".join(f"{key[5:]} {statistics.median(row[key] for row in rows):.3f}" for key in phases if
                    all(key in row for row in rows)))
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    print(f"\noperators by self time (all of the run, {total / 1e6:.1f} s of this process's operators)")
    print(f"{'operator':48}{'self s':>9}{'share':>8}{'calls':>9}")
    for event in sorted(events, key=lambda e: -e.self_cpu_time_total)[:20]:
        print(f"{event.key[:47]:48}{event.self_cpu_time_total / 1e6:9.2f}{event.self_cpu_time_total / total:8.1%}"
              f"{event.count:9d}")


if __name__ == "__main__":
    main()
