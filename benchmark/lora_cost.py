"""What LoRA saves on SmolLM2-135M-Instruct (assets/smollm2, built offline by assets/make_smollm2.py), against full
fine-tuning, at the README recipe (docs/real_models.md; rank 16 and alpha 32 as benchmark/smollm2_lora.py, every
linear layer but the output layer), in float32 on this CPU:
- the learner's peak memory: rloo.py, 2 updates (no vLLM process: the peak resident memory of the run's one process;
  full fine-tuning holds a reference copy, LoRA none);
- the hand-off per update: rloo_vllm.py, 4 updates one update late, through files (the only hand-off an adapter
  takes): the bytes the run's first lines report, the learner's seconds (time/weight_sync: gather and write), the
  generator's (time/weight_load: wait for and load the new version), and episodes per second.
Prints one line per run.

    python benchmark/lora_cost.py | tee benchmark/results/lora_cost.txt   # about 15 min on 2 cores
"""

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = ["--sft-model-path", "assets/smollm2/model", "--dataset-name", "assets/smollm2/data", "--rule-reward",
          "last_number", "--response-length", "16", "--max-prompt-length", "64", "--k", "4",
          "--per-device-train-batch-size", "32", "--missing-eos-penalty", "0", "--eval-every", "0"]
MODES = {"full": ["--learning-rate", "1e-5"], "LoRA": ["--lora-rank", "16", "--lora-alpha", "32", "--learning-rate", "1e-4"]}
PEAK = "import resource, subprocess, sys; code = subprocess.run(sys.argv[1:]).returncode; " \
       "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, code)"  # KiB, of the run alone


def run(script, mode, updates, extra=()):
    """(metrics rows, stdout, peak resident KiB of the run's largest process, seconds)."""
    with tempfile.TemporaryDirectory() as out:
        started = time.time()
        result = subprocess.run([sys.executable, "-c", PEAK, sys.executable, script, *RECIPE, *MODES[mode], *extra,
                                 "--total-episodes", str(32 * updates), "--output-dir", out], cwd=ROOT,
                                capture_output=True, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
        peak, code = map(int, result.stdout.split()[-2:])
        if code:
            sys.exit(f"{script} {mode}: exit {code}\n{result.stderr[-2000:]}")
        (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], result.stdout, peak, time.time() - started


def mean(rows, key):
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values)


def main():
    if not os.path.isfile(os.path.join(ROOT, "assets", "smollm2", "model", "model.safetensors")):
        subprocess.run([sys.executable, "assets/make_smollm2.py"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {' '.join(sys.argv)} on {cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")
    print(f"# recipe: {' '.join(RECIPE)}; full: {' '.join(MODES['full'])}; LoRA: {' '.join(MODES['LoRA'])}")
    for mode in MODES:
        rows, _, peak, seconds = run("rloo.py", mode, 2)
        print(f"rloo.py {mode}: learner peak resident memory {peak / 2**20:.2f} GiB; "
              f"{rows[-1]['time/episodes_per_second']:.3f} episodes/s; {seconds:.0f} s")
    for mode in MODES:
        rows, stdout, _, seconds = run("rloo_vllm.py", mode, 4, ["--weight-sync", "file", "--vllm-enforce-eager"])
        handed = re.search(r"the policy goes to vLLM after each update (.*)", stdout).group(1)
        print(f"rloo_vllm.py {mode}: hand-off {handed}; per update (mean of updates 2-4) the learner's side "
              f"{mean(rows[2:], 'time/weight_sync'):.3f} s, the generator's {mean(rows[2:], 'time/weight_load'):.3f} s; "
              f"{rows[-1]['time/episodes_per_second']:.3f} episodes/s; {seconds:.0f} s")


if __name__ == "__main__":
    main()
