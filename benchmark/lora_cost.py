"""What LoRA saves on SmolLM2-135M-Instruct (assets/smollm2, built offline by assets/make_smollm2.py), against full
fine-tuning, at the README recipe (docs/real_models.md; rank 16 and alpha 32 as benchmark/smollm2_lora.py, every
linear layer but the output layer), in float32 on this CPU:
- the learner's peak memory: rloo.py, 2 updates (no vLLM process: the peak resident memory of the run's one process;
  full fine-tuning holds a reference copy, LoRA none);
- the hand-off per update: rloo_vllm.py, 4 updates one update late, through files (the only hand-off an adapter
  takes): the bytes the run's first lines report, the learner's seconds (time/weight_sync: gather and write), the
  generator's (time/weight_load: it waits for the new version, so this is mostly the learner's update), and episodes
  per second;
- vLLM's side alone (--part load): one engine with LoRA enabled loads a new version 3 times each way, as the
  generator does: the adapter's directory (vllm_engine.swap_adapter) against the full weights' (load_into_vllm).
Prints one line per run or measurement.

    python benchmark/lora_cost.py | tee benchmark/results/lora_cost.txt   # about 15 min on 2 cores
    python benchmark/lora_cost.py --part load                             # the last part alone, 1 min
"""

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

from smollm2_sync_mismatch import start

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


def vllm_loads():
    """Seconds per load of a new version into one engine: the adapter (rank 16), then the full weights; 3 each."""
    sys.path.insert(0, ROOT)
    import torch
    from transformers import AutoModelForCausalLM

    import data
    import rloo_vllm
    import vllm_engine
    from weight_handoff import write_for_vllm

    path = os.path.join(ROOT, "assets", "smollm2", "model")
    args = rloo_vllm.Args(bf16=False, sft_model_path=path, response_length=16, max_prompt_length=64, lora_rank=16)
    args.world_size = 1
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with tempfile.TemporaryDirectory() as tmp:
        write_for_vllm(model, model.state_dict(), os.path.join(tmp, "full"))
        data.with_lora(args, model).save_pretrained(os.path.join(tmp, "policy-0"))
        llm = vllm_engine.start_vllm(args, path, lora_rank=16, sizes=vllm_engine.parameter_bytes(model))
        try:
            adapter, seconds = vllm_engine.add_adapter(llm, 0, os.path.join(tmp, "policy-0")), {"adapter": [], "full": []}
            for version in (1, 2, 3):
                shutil.copytree(os.path.join(tmp, f"policy-{version - 1}"), os.path.join(tmp, f"policy-{version}"))
                started = time.time()
                adapter = vllm_engine.swap_adapter(llm, adapter, version, os.path.join(tmp, f"policy-{version}"))
                llm.generate("1 + 1 =", lora_request=adapter, use_tqdm=False)  # vLLM loads an adapter when first asked
                seconds["adapter"].append(time.time() - started)
                started = time.time()
                vllm_engine.load_into_vllm(llm, os.path.join(tmp, "full"))
                llm.generate("1 + 1 =", use_tqdm=False)  # the same request, for a like comparison
                seconds["full"].append(time.time() - started)
        finally:
            vllm_engine.shut_down(llm)
    return {kind: sum(values) / len(values) for kind, values in seconds.items()}


def mean(rows, key):
    values = [row[key] for row in rows if key in row]
    return sum(values) / len(values)


def main():
    start()
    print(f"# recipe: {' '.join(RECIPE)}; full: {' '.join(MODES['full'])}; LoRA: {' '.join(MODES['LoRA'])}")
    if sys.argv[1:] == ["--part", "load"]:
        loads = vllm_loads()
        print(f"vLLM loads a new version (mean of 3): the adapter {loads['adapter']:.3f} s, "
              f"the full weights {loads['full']:.3f} s (each with one request of 16 tokens after it)")
        return
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
