"""Training throughput of our scripts against TRL on identical work, measured in one invocation.

The workload (built here, from nothing, in a temporary directory): a Llama policy and a Llama reward
model from config (hidden 256, intermediate 512, 4 layers, 4 heads: 3.1 M parameters), a byte-level
BPE tokenizer of 1000 tokens trained on the tiny task's prompts, and those prompts (about 20 tokens).
Every update samples 16 prompts x 2 completions x 32 new tokens at temperature 0.7 and trains once
on them. Each run is a fresh process; the runs are interleaved (round 1 of every system and
precision, then round 2, ...) so that a slow patch of the machine hits all of them alike. Episodes
per second are timed from the end of the 2nd update to the end of the last (start-up, compilation
and the first updates' warm-up excluded), and the table shows their minimum and median over rounds,
our ratio to TRL at the same precision, our per-phase split (seconds per update) and the training
phase's useful FLOP/s (2 x matmul parameters x passes x real tokens) against this machine's matmul
peak, measured in the same invocation; then HF `generate` against the scripts' decoding loop on one
batch. docs/performance.md has the results and what they mean.

With `--task smollm2` the workload is a real pretrained chat model instead, SmolLM2-135M-Instruct on chat
one-digit sums with the last-number rule as reward (assets/make_smollm2.py builds both), at the settings that
learn there (docs/results.md): 8 prompts x 4 completions x 16 new tokens an update, learning rate 3e-6; `rloo.py`
against TRL's RLOOTrainer (TRL applies the same chat template and is given the same rule as a reward function).

    python benchmark/throughput.py               # 3 rounds, fp32 and bf16, ours and TRL: about 22 minutes
    python benchmark/throughput.py --quick       # CI: our scripts once, fp32, 6 updates, no TRL
    python benchmark/throughput.py --task smollm2 --rounds 1 --updates 6 --precision fp32   # about 12 minutes
    git worktree add ../before REV && python benchmark/throughput.py --no-trl --baseline ../before   # against REV
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROMPTS, COMPLETIONS, NEW_TOKENS, TEMPERATURE = 16, 2, 32, 0.7
BATCH = PROMPTS * COMPLETIONS  # responses (episodes) per update

# Our scripts with the arguments that make one update = 16 prompts x 2 responses, trained in one step.
# PPO samples one response per prompt, so it takes 32 prompts to make the same 32 episodes.
OURS = {
    "rloo.py": ["--k", "2"],
    "online_dpo.py": ["--k", "2"],
    "bok.py": ["--k", "2"],
    "ppo.py": [],
    "online_dpo_vllm.py": ["--k", "2"],
}
# The TRL trainer each of our scripts is compared with.
BASELINE = {"rloo.py": "trl RLOOTrainer", "rloo_vllm.py": "trl RLOOTrainer", "rloo_vllm.py --sync": "trl RLOOTrainer",
            "online_dpo.py": "trl OnlineDPOTrainer",
            "online_dpo_vllm.py": "trl OnlineDPOTrainer"}
# What the training phase (time/training) computes per update: sequences, and passes over them in units of
# a forward (backward = 2). rloo.py's training forward runs in its scoring phase (the ratio is 1), so its
# training phase is the backward alone; bok.py trains on the best of each prompt's 2 responses.
TRAINING_WORK = {"rloo.py": (BATCH, 2), "rloo_vllm.py": (BATCH, 2), "rloo_vllm.py --sync": (BATCH, 2), "online_dpo.py": (BATCH, 3), "bok.py": (PROMPTS, 3), "ppo.py": (BATCH, 3),
                 "online_dpo_vllm.py": (BATCH, 3)}


# The real-model workload (--task smollm2): what one update is, for our rloo.py and TRL's RLOOTrainer alike; rloo_vllm.py
# (asynchronous, or with --sync) can run it too.
SMOLLM2_SCRIPTS = ["rloo.py", "rloo_vllm.py", "rloo_vllm.py --sync"]
SMOLLM2 = dict(prompts=8, completions=4, new_tokens=16, learning_rate=3e-6)
SMOLLM2_OURS = ["--sft-model-path", "assets/smollm2/model", "--dataset-name", "assets/smollm2/data", "--rule-reward",
                "last_number", "--k", "4", "--max-prompt-length", "64", "--missing-eos-penalty", "0",
                "--learning-rate", "3e-6"]


def build_smollm2_workload(directory):
    """The chat prompts with their answers as TRL reads them (`prompt`: the messages); the policy is
    assets/smollm2/model. Returns the mean prompt length in tokens, chat template included."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "assets/smollm2/model"))
    with open(os.path.join(ROOT, "assets/smollm2/data/train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    os.makedirs(os.path.join(directory, "data"))
    with open(os.path.join(directory, "data", "train.jsonl"), "w") as f:
        for row in rows:
            f.write(json.dumps({"prompt": row["messages"], "answer": row["answer"]}) + "\n")
    # (the template's text tokenised as the scripts do: apply_chat_template(tokenize=True) returns a BatchEncoding
    # in transformers 5, whose len() is its number of fields)
    lengths = [len(tokenizer.encode(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True,
                                                                  tokenize=False), add_special_tokens=False))
               for row in rows]
    return sum(lengths) / len(lengths)


def build_workload(directory):
    """Tokenizer, policy, reward model and prompts; deterministic. Returns the mean prompt length in tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification, PreTrainedTokenizerFast

    with open(os.path.join(ROOT, "assets/tiny/data/train.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    # Merges across word boundaries: the tiny task has too few distinct words to fill 1000 tokens otherwise.
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=["<|endoftext|>", "<|padding|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator([row["query"] + row["reference_response"] for row in rows], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>", pad_token="<|padding|>")

    config = dict(vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                  num_attention_heads=4, max_position_embeddings=128, tie_word_embeddings=False,
                  bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
                  pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    for name, model in (("policy", LlamaForCausalLM(LlamaConfig(**config))),
                        ("reward", LlamaForSequenceClassification(LlamaConfig(num_labels=1, **config)))):
        model.save_pretrained(os.path.join(directory, name))
        tokenizer.save_pretrained(os.path.join(directory, name))

    # `query` is the column our scripts read, `prompt` the one TRL reads.
    os.makedirs(os.path.join(directory, "data"))
    for split, size in (("train", 4096), ("test", 64)):
        with open(os.path.join(directory, "data", f"{split}.jsonl"), "w") as f:
            for row in rows[:size]:
                f.write(json.dumps({"query": row["query"], "prompt": row["query"]}) + "\n")
    lengths = [len(tokenizer(row["query"])["input_ids"]) for row in rows[:4096]]
    return sum(lengths) / len(lengths)


def matmul_params(path):
    """Parameters that take part in matrix multiplications (all but the input embedding)."""
    from safetensors import safe_open

    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        return sum(f.get_slice(name).get_shape()[0] * f.get_slice(name).get_shape()[1]
                   for name in f.keys() if name.endswith("weight") and "embed_tokens" not in name
                   and len(f.get_slice(name).get_shape()) == 2)


def matmul_peak(dtype, size=2048, repeats=10):
    """This machine's matmul FLOP/s at a large square size, best of `repeats`."""
    a, b = torch.randn(size, size, dtype=dtype), torch.randn(size, size, dtype=dtype)
    a @ b  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size ** 3 / best


def generation_seconds(workload, dtype, repeats=5):
    """Seconds per batch of HF `generate` and of the scripts' `generate` (same tokens), best of `repeats`,
    on the workload's policy and one batch of its prompts."""
    sys.path.insert(0, ROOT)
    import data
    import rloo  # every script has the same `generate`
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(f"{workload}/policy")
    model = AutoModelForCausalLM.from_pretrained(f"{workload}/policy", dtype=dtype).eval()
    with open(f"{workload}/data/train.jsonl") as f:
        prompts = [json.loads(line)["query"] for line in f][:PROMPTS]
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    queries = data.left_pad(tokenizer(prompts)["input_ids"], pad, "cpu").repeat(COMPLETIONS, 1)
    ways = {
        "HF generate": lambda: model.generate(input_ids=queries, attention_mask=queries != pad, do_sample=True,
                                              temperature=TEMPERATURE, top_k=0, top_p=1.0, max_new_tokens=NEW_TOKENS,
                                              eos_token_id=eos, pad_token_id=pad),
        "ours": lambda: rloo.generate(model, queries, pad, eos, NEW_TOKENS, TEMPERATURE),
    }
    best = {name: float("inf") for name in ways}
    for _ in range(repeats + 1):  # the first call of each is a warm-up
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run_ours(system, precision, workload, updates, output_dir, quick, task="tiny", root=ROOT):
    script, *flags = system.split()  # ("rloo_vllm.py --sync": the script and its flags)
    if task == "smollm2":
        batch = SMOLLM2["prompts"] * SMOLLM2["completions"]
        command = [sys.executable, script, *flags, *SMOLLM2_OURS, "--response-length", str(SMOLLM2["new_tokens"]),
                   "--per-device-train-batch-size", str(batch), "--total-episodes", str(batch * updates)]
    else:
        command = [sys.executable, script, *OURS[script], "--sft-model-path", f"{workload}/policy",
                   "--reward-model-path", f"{workload}/reward", "--gold-reward-model-path", "None",
                   "--dataset-name", f"{workload}/data", "--response-length", str(NEW_TOKENS),
                   "--per-device-train-batch-size", str(BATCH), "--total-episodes", str(BATCH * updates)]
    command += ["--temperature", str(TEMPERATURE), "--eval-every", "0", "--num-eval-prompts", "16",
                "--output-dir", output_dir, "--bf16" if precision == "bf16" else "--no-bf16"]
    if script == "online_dpo_vllm.py" and quick:
        command.append("--vllm-enforce-eager")  # skips ~30 s of compilation; generation is slower
    subprocess.run(command, cwd=root, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    (run_name,) = os.listdir(output_dir)
    with open(os.path.join(output_dir, run_name, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f][1:]  # row 0 is the evaluation before training
    # time/episodes_per_second counts from the start of the 1st update, so episode / eps is the time at the end of an update.
    end = [row["episode"] / row["time/episodes_per_second"] for row in rows]
    timed = rows[2:]
    for row in timed:  # generation: the learner's (HF) or vLLM's, in the background when asynchronous
        row["time/generation"] = row.get("time/generation", row.get("time/vllm_generation"))
    phases = {name: statistics.mean(row.get(f"time/{name}", 0.0) for row in timed)
              for name in ("generation", "generation_wait", "scoring", "training", "weight_sync")}
    eps = (rows[-1]["episode"] - rows[1]["episode"]) / (end[-1] - end[1])
    idle = phases["generation_wait"] / ((rows[-1]["episode"] - rows[1]["episode"]) / (len(rows) - 2) / eps)
    return {"eps": eps, **phases, "learner_idle": idle,
            "response_length": statistics.mean(row["val/response_length"] for row in timed)}


def run_trl(trainer, precision, workload, updates, output_dir, task="tiny"):
    """Runs this file as a TRL worker in a fresh process; returns its episodes per second."""
    result = os.path.join(output_dir, "result.json")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--trl-worker", trainer, "--precision", precision,
                    "--workload", workload, "--updates", str(updates), "--output", result, "--task", task],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    with open(result) as f:
        return json.load(f)


def trl_device():
    """TRL's device arguments: the device our scripts train on (a GPU when there is one), so both run on the same."""
    return {"use_cpu": not torch.cuda.is_available()}


def trl_worker(trainer, precision, workload, updates, output, task="tiny"):
    """One TRL run on the workload with its fastest fair settings; writes the update end times."""
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    class UpdateTimes(TrainerCallback):
        times = []

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.time())

    common = dict(output_dir=os.path.dirname(output), max_steps=updates, learning_rate=2e-5, temperature=TEMPERATURE,
                  top_k=0, top_p=1.0, gradient_checkpointing=False, bf16=precision == "bf16", **trl_device(),
                  report_to=[], save_strategy="no", logging_steps=10 ** 6, disable_dropout=True, seed=1)
    if task == "smollm2":
        from trl import RLOOConfig, RLOOTrainer

        sys.path.insert(0, ROOT)
        from rloo import last_number_reward

        def last_number(completions, answer, **kwargs):  # the rule our --rule-reward last_number applies
            return [last_number_reward(c[-1]["content"], a) for c, a in zip(completions, answer)]

        model = os.path.join(ROOT, "assets/smollm2/model")
        config = RLOOConfig(per_device_train_batch_size=SMOLLM2["prompts"] * SMOLLM2["completions"],
                            num_generations=SMOLLM2["completions"], max_completion_length=SMOLLM2["new_tokens"],
                            beta=0.05, **{**common, "learning_rate": SMOLLM2["learning_rate"]})
        run = RLOOTrainer(model=AutoModelForCausalLM.from_pretrained(model), reward_funcs=last_number, args=config,
                          train_dataset=load_dataset("json", data_files=f"{workload}/data/train.jsonl", split="train"),
                          processing_class=AutoTokenizer.from_pretrained(model), callbacks=[UpdateTimes()])
        run.train()
        times = UpdateTimes.times
        with open(output, "w") as f:
            json.dump({"eps": config.per_device_train_batch_size * (len(times) - 2) / (times[-1] - times[1])}, f)
        return
    dataset = load_dataset("json", data_files=f"{workload}/data/train.jsonl", split="train").remove_columns("query")
    policy = AutoModelForCausalLM.from_pretrained(f"{workload}/policy")
    tokenizer = AutoTokenizer.from_pretrained(f"{workload}/policy")
    if trainer == "rloo":
        from trl import RLOOConfig, RLOOTrainer

        config = RLOOConfig(per_device_train_batch_size=BATCH, num_generations=COMPLETIONS,
                            max_completion_length=NEW_TOKENS, beta=0.05, **common)
        run = RLOOTrainer(model=policy, reward_funcs=f"{workload}/reward", args=config, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[UpdateTimes()])
    else:
        from trl.experimental.online_dpo import OnlineDPOConfig, OnlineDPOTrainer

        config = OnlineDPOConfig(per_device_train_batch_size=PROMPTS, max_new_tokens=NEW_TOKENS, beta=[0.1], **common)
        run = OnlineDPOTrainer(model=policy, ref_model=AutoModelForCausalLM.from_pretrained(f"{workload}/policy"),
                               reward_funcs=f"{workload}/reward", args=config, train_dataset=dataset,
                               processing_class=tokenizer, callbacks=[UpdateTimes()])
    run.train()
    times = UpdateTimes.times
    with open(output, "w") as f:
        json.dump({"eps": BATCH * (len(times) - 2) / (times[-1] - times[1])}, f)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="interleaved repetitions of every run")
    parser.add_argument("--updates", type=int, default=20, help="updates per run (the first 2 are not timed)")
    parser.add_argument("--precision", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--scripts", nargs="*", choices=list(OURS) + SMOLLM2_SCRIPTS[1:],
                        help=f"default: {' '.join(OURS)}; with --task smollm2 one or more of {SMOLLM2_SCRIPTS}, "
                             "default rloo.py")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL (it is not in the user's install)")
    parser.add_argument("--quick", action="store_true", help="one round, fp32, 6 updates, no TRL (for CI)")
    parser.add_argument("--task", choices=["tiny", "smollm2"], default="tiny",
                        help="tiny: 3.1 M-parameter models built here; smollm2: SmolLM2-135M-Instruct, rloo.py and TRL's RLOO")
    parser.add_argument("--baseline", metavar="DIR", help="also run the scripts of another checkout (an earlier "
                        "commit: `git worktree add DIR REV`), as 'SCRIPT (baseline)', interleaved with ours")
    parser.add_argument("--trl-worker", choices=["rloo", "online_dpo"], help=argparse.SUPPRESS)
    parser.add_argument("--workload", help=argparse.SUPPRESS)
    parser.add_argument("--output", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.trl_worker:
        return trl_worker(options.trl_worker, options.precision[0], options.workload, options.updates, options.output,
                          options.task)
    if options.quick:
        options.rounds, options.updates, options.precision, options.no_trl = 1, 6, ["fp32"], True
    if options.updates < 4:
        parser.error("--updates: at least 4 (2 warm-up updates, then at least 2 timed)")
    smollm2 = options.task == "smollm2"
    if smollm2:
        options.scripts = options.scripts or ["rloo.py"]
        if set(options.scripts) - set(SMOLLM2_SCRIPTS):
            parser.error(f"--scripts: with --task smollm2, one or more of {SMOLLM2_SCRIPTS}")
        from smollm2_sync_mismatch import build_smollm2  # (this script's folder)
        build_smollm2()

    options.scripts = options.scripts or list(OURS)
    baselines = [f"{script} (baseline)" for script in options.scripts] if options.baseline else []
    systems = list(options.scripts) + baselines + ([] if options.no_trl else ["trl RLOOTrainer"] + ([] if smollm2 else
                                                                                        ["trl OnlineDPOTrainer"]))
    results = {(system, precision): [] for system in systems for precision in options.precision}
    peaks = {precision: 0.0 for precision in options.precision}
    generation = {precision: [] for precision in options.precision}
    with tempfile.TemporaryDirectory() as tmp:
        workload = os.path.join(tmp, "workload")
        if smollm2:
            prompt_length = build_smollm2_workload(workload)
            policy_params, value_params = matmul_params(os.path.join(ROOT, "assets/smollm2/model")), 0
            # (SmolLM2's output layer is the input embedding: it takes part in matmuls but is not counted)
        else:
            prompt_length = build_workload(workload)
            policy_params, value_params = matmul_params(f"{workload}/policy"), matmul_params(f"{workload}/reward")
        for round_ in range(1, options.rounds + 1):
            for precision in options.precision:
                dtype = torch.float32 if precision == "fp32" else torch.bfloat16
                peaks[precision] = max(peaks[precision], matmul_peak(dtype))
                if not smollm2:
                    generation[precision].append(generation_seconds(workload, dtype))
                for system in systems:
                    print(f"round {round_}/{options.rounds}, {precision}: {system} ...", flush=True)
                    output_dir = tempfile.mkdtemp(dir=tmp)
                    try:
                        if system.startswith("trl"):
                            trainer = "rloo" if system == "trl RLOOTrainer" else "online_dpo"
                            result = run_trl(trainer, precision, workload, options.updates, output_dir, options.task)
                        else:
                            script = system.removesuffix(" (baseline)")
                            result = run_ours(script, precision, workload, options.updates, output_dir, options.quick,
                                              options.task, options.baseline if system in baselines else ROOT)
                    except subprocess.CalledProcessError as error:
                        sys.exit(f"{system} ({precision}) failed:\n{error.stderr.decode()[-3000:]}")
                    if system.removesuffix(" (baseline)") in TRAINING_WORK:
                        sequences, passes = TRAINING_WORK[system.removesuffix(" (baseline)")]
                        if smollm2:
                            sequences = SMOLLM2["prompts"] * SMOLLM2["completions"]
                        params = policy_params + (value_params if system.startswith("ppo.py") else 0)  # PPO: both
                        tokens = sequences * (prompt_length + result["response_length"])  # real tokens, no padding
                        result["train_flops"] = 2 * params * passes * tokens / result["training"]
                    results[system, precision].append(result)

    shape = (SMOLLM2["prompts"], SMOLLM2["completions"], SMOLLM2["new_tokens"]) if smollm2 else (PROMPTS, COMPLETIONS,
                                                                                                 NEW_TOKENS)
    print(f"\n{options.task}: {shape[0]} prompts x {shape[1]} completions x {shape[2]} tokens per update, {options.updates} updates"
          f" per run (the last {options.updates - 2} timed), {options.rounds} round(s), {torch.get_num_threads()} threads")
    header = (f"{'':22}{'eps min':>9}{'median':>9}{'x TRL':>7}   {'gen':>6}{'wait':>6}{'score':>6}{'train':>6}"
              f"{'sync':>6}   {'train GFLOP/s':>13}{'of peak':>8}")
    for precision in options.precision:
        print(f"\n{precision} (matmul peak {peaks[precision] / 1e9:.0f} GFLOP/s)\n{header}")
        median = {system: statistics.median(r["eps"] for r in results[system, precision]) for system in systems}
        for system in systems:
            runs = results[system, precision]
            line = f"{system:22}{min(r['eps'] for r in runs):9.1f}{median[system]:9.1f}"
            baseline = BASELINE.get(system.removesuffix(" (baseline)"))
            line += f"{median[system] / median[baseline]:7.2f}" if baseline in median else f"{'':7}"
            if not system.startswith("trl"):
                phase = {name: statistics.median(r[name] for r in runs)
                         for name in ("generation", "generation_wait", "scoring", "training", "weight_sync", "train_flops")}
                line += (f"   {phase['generation']:6.3f}{phase['generation_wait']:6.3f}{phase['scoring']:6.3f}"
                         f"{phase['training']:6.3f}{phase['weight_sync']:6.3f}"
                         f"   {phase['train_flops'] / 1e9:13.1f}{phase['train_flops'] / peaks[precision]:8.0%}")
            print(line)
        for system in systems:
            if "vllm" in system:
                idle = statistics.median(r["learner_idle"] for r in results[system, precision])
                print(f"{system}: the learner waits for its batch {idle:.0%} of an update")
    for precision in options.precision if baselines else []:
        median = {system: statistics.median(r["eps"] for r in results[system, precision]) for system in systems}
        print(f"\n{precision}, ours against the baseline checkout {options.baseline} (median over median): "
              + ", ".join(f"{script} {median[script] / median[f'{script} (baseline)']:.2f}x" for script in options.scripts))
    for precision in options.precision if generation[options.precision[0]] else []:
        seconds = {name: statistics.median(g[name] for g in generation[precision]) for name in generation[precision][0]}
        print(f"\n{precision} generation of one batch, {BATCH} x {NEW_TOKENS} tokens (median of best-of-5): "
              + ", ".join(f"{name} {value:.3f} s" for name, value in seconds.items()))
    print("\neps: episodes (sampled responses) per second; x TRL: median over median, against the TRL trainer of the"
          "\nsame algorithm; phases: median seconds per update (wait: the vLLM learner's wait for a batch)")


if __name__ == "__main__":
    main()
