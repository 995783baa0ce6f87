"""vLLM samples from the learner's policy in every *_vllm.py: each runs `--sync` (on-policy) on SmolLM2-135M-Instruct
(assets/smollm2, built offline by assets/make_smollm2.py) in float32 for 3 updates, every hand-off checked, and the
KL between vLLM's log-probabilities of the sampled tokens and the learner's (`async/mismatch_kl`) is printed at every
update with whether it stays under 1e-6 (what tests/test_real_model.py holds rloo_vllm.py to in CI).

    python benchmark/smollm2_sync_mismatch.py | tee benchmark/results/smollm2_sync_mismatch.txt   # about 10 min on 2 cores
"""

import json
import os
import platform
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ["rloo_vllm.py", "online_dpo_vllm.py", "bok_vllm.py", "ppo_vllm.py", "grpo_vllm.py", "tba_vllm.py"]
RUN = ["--sft-model-path", "assets/smollm2/model", "--dataset-name", "assets/smollm2/data", "--rule-reward",
       "last_number", "--max-prompt-length", "56", "--response-length", "8", "--per-device-train-batch-size", "4",
       "--total-episodes", "12", "--num-eval-prompts", "8", "--eval-every", "0", "--missing-eos-penalty", "0",
       "--learning-rate", "5e-5", "--no-bf16", "--vllm-enforce-eager", "--sync", "--check-weights-every", "1"]


def build_smollm2():
    """Build assets/smollm2's model (assets/make_smollm2.py, about a minute) if it is missing."""
    if not os.path.isfile(os.path.join(ROOT, "assets", "smollm2", "model", "model.safetensors")):
        print("building assets/smollm2/model (python assets/make_smollm2.py)", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "assets/make_smollm2.py"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)


def start():
    """Build assets/smollm2 if it is missing; print the command, the machine and the date (every SmolLM2 benchmark's
    first line)."""
    build_smollm2()
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
               platform.processor())
    print(f"# {' '.join(sys.argv)} on {cpu}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d')}")


def main():
    start()
    for script in SCRIPTS:
        k = [] if script == "ppo_vllm.py" else ["--k", "2"]  # PPO samples one response per prompt
        with tempfile.TemporaryDirectory() as out:
            started = time.time()
            subprocess.run([sys.executable, script, *RUN, *k, "--output-dir", out], cwd=ROOT, check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            (name,) = os.listdir(out)
            with open(os.path.join(out, name, "metrics.jsonl")) as f:
                mismatch = [json.loads(line)["async/mismatch_kl"] for line in f if "async/mismatch_kl" in line]
        print(f"{script}: async/mismatch_kl {' '.join(f'{m:.2e}' for m in mismatch)}; every update under 1e-6: "
              f"{len(mismatch) == 3 and max(mismatch) < 1e-6} ({time.time() - started:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
