"""rloo_vllm.py with a LoRA adapter on SmolLM2-135M-Instruct (assets/smollm2, built offline by assets/make_smollm2.py):
the README's recipe (docs/real_models.md: 10 updates of 32 responses, held-out greedy accuracy on 96 prompts at
updates 0, 5 and 10) with --lora-rank 16 --lora-alpha 32 on every linear layer but the output layer, `--sync` and
asynchronous (one update late). The learning rate is ten times the recipe's full fine-tuning one (1e-4 against 1e-5):
the ratio "LoRA Without Regret" (Schulman et al., Thinking Machines, 2025) found best; no sweep here. Every weight check
runs (--check-weights-every 1). Prints each run's accuracies, its hand-off size and its time.

    python benchmark/smollm2_lora.py | tee benchmark/results/smollm2_lora.txt   # about 20 min on 2 cores
"""

import json
import os
import re
import subprocess
import sys
import tempfile
import time

from smollm2_sync_mismatch import start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = ["--sft-model-path", "assets/smollm2/model", "--dataset-name", "assets/smollm2/data", "--rule-reward",
          "last_number", "--response-length", "16", "--max-prompt-length", "64", "--k", "4",
          "--per-device-train-batch-size", "32", "--missing-eos-penalty", "0", "--num-eval-prompts", "96",
          "--eval-every", "5", "--total-episodes", "320"]
LORA = ["--lora-rank", "16", "--lora-alpha", "32", "--learning-rate", "1e-4", "--check-weights-every", "1"]


def main():
    start()
    print(f"# rloo_vllm.py {' '.join(RECIPE + LORA)} [--sync]")
    for mode in ("sync", "async"):
        with tempfile.TemporaryDirectory() as out:
            started = time.time()
            result = subprocess.run([sys.executable, "rloo_vllm.py", *RECIPE, *LORA, "--output-dir", out,
                                     *(["--sync"] if mode == "sync" else [])], cwd=ROOT, capture_output=True,
                                    text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
            seconds = time.time() - started
            if result.returncode != 0:
                print(f"{mode}: exit {result.returncode}\n{result.stderr[-2000:]}")
                continue
            (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
            with open(os.path.join(run_dir, "metrics.jsonl")) as f:
                rows = [json.loads(line) for line in f]
            accuracy = " ".join(f"{row['update']}:{row['eval/scores']:.3f}" for row in rows if "eval/scores" in row)
            handed = re.search(r"the policy goes to vLLM .*", result.stdout)
            mismatch = max(row["async/mismatch_kl"] for row in rows[1:])
            print(f"{mode}: held-out accuracy by update {accuracy}; largest async/mismatch_kl {mismatch:.1e}; "
                  f"{handed.group(0) if handed else ''}; {seconds:.0f} s")


if __name__ == "__main__":
    main()
