"""grpo_tools_vllm.py on a real chat model: SmolLM2-135M-Instruct (assets/smollm2) on products of two two-digit
numbers (assets/smollm2/tools, built by assets/make_smollm2.py), whose system prompt describes a calculator in GSM8K's
format (`<<47*38=` is a call, the environment appends `1786>>`).

SmolLM2 as it is never calls the calculator (0 calls in 128 episodes), so RL has nothing to raise; as
assets/make_tiny_tools.py does for the tiny model, this first builds an SFT policy: a short fine-tuning on
demonstrations that call the calculator in TOOL_SHARE of the problems (`<<47*38=`, the environment's `1786>>`, then
` The answer is 1786.`) and answer at once, rightly, in the others (`The answer is 1786.`), trained on the policy's
tokens only (the result is read, never imitated; each segment tokenized on its own, as vLLM and the environment
produce them). Then grpo_tools_vllm.py trains it, seeds 1 and 2, batch-async (K = 1) and --sync, with held-out greedy
accuracy at the start, middle and end. Prints the SFT policy's first-turn rates, then each run's figures.

    python benchmark/grpo_tools_smollm2.py | tee benchmark/results/grpo_tools_smollm2.txt   # about 45 min on 2 cores
    python benchmark/grpo_tools_smollm2.py --seeds 1 --modes async --extra "--generation streaming --lora-rank 16 \
        --lora-alpha 32 --learning-rate 3e-4"   # streaming episodes with a LoRA adapter
"""

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import tempfile
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from smollm2_sync_mismatch import start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "assets", "smollm2", "model")
DATA = os.path.join(ROOT, "assets", "smollm2", "tools")
TOOL_SHARE = 0.3  # share of the demonstrations that call the calculator (the tiny tool task's)
CALL, RESULT = "<<{}=", "{}>>"
# The prompts are 88 tokens (the system prompt's 60 among them); an episode with a call is 22 tokens (7 for the call,
# 5 for the result, 10 for the answer); --max-turns 2: a call and the answer (a second call ends at the turn limit).
# Batches of 32 episodes in micro-batches of 8 (one pass of 32 was killed for memory at 12.5 GB on the 24 GB shared
# with other jobs). The learning rate is three times the SmolLM2 recipe's 1e-5 (docs/real_models.md): 8 updates.
RUN = ["--dataset-name", "assets/smollm2/tools", "--tool-call", CALL, "--tool-result", RESULT, "--rule-reward",
       "last_number", "--max-prompt-length", "96", "--response-length", "32", "--max-turns", "2", "--k", "4",
       "--per-device-train-batch-size", "8", "--gradient-accumulation-steps", "4", "--total-episodes", "256",
       "--learning-rate", "3e-5", "--eval-every", "4", "--num-eval-prompts", "64", "--vllm-enforce-eager"]
FIGURES = ["tools/tool_rate", "objective/raw_scores", "tools/calls", "tools/errors", "tools/turn_limit",
           "tools/accuracy_with_tool", "tools/accuracy_without_tool"]


def read_rows(split):
    with open(os.path.join(DATA, f"{split}.jsonl")) as f:
        return [json.loads(line) for line in f]


def prompt_ids(tokenizer, row):
    """The prompt as data.py makes it: the chat template's text with its generation prompt."""
    text = tokenizer.apply_chat_template(row["messages"], tokenize=False, add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


def demonstration(tokenizer, row, tool):
    """A reference's response ids and loss mask (1 where the policy wrote the token), segment by segment."""
    a, b = re.findall(r"\d+", row["messages"][-1]["content"])
    answer = row["answer"]
    segments = ([(CALL.format(f"{a}*{b}"), 1), (RESULT.format(answer), 0), (f" The answer is {answer}.", 1)] if tool
                else [(f"The answer is {answer}.", 1)])
    ids, mask = [], []
    for text, policy in segments:
        segment = tokenizer.encode(text, add_special_tokens=False)
        ids, mask = ids + segment, mask + [policy] * len(segment)
    return ids + [tokenizer.eos_token_id], mask + [1]


def build_sft(out, steps, batch_size, learning_rate, seed):
    """Fine-tune SmolLM2 on the demonstrations (next-token loss on the policy's tokens), save it to `out`."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(MODEL)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    rng = random.Random(seed)
    rows = read_rows("train")
    optimizer = torch.optim.AdamW(model.parameters(), lr=learning_rate)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)
    losses = []
    for step in range(steps):
        batch = [(prompt_ids(tokenizer, row), *demonstration(tokenizer, row, rng.random() < TOOL_SHARE))
                 for row in rng.sample(rows, batch_size)]
        length = max(len(p) + len(r) for p, r, _ in batch)
        ids = torch.full((batch_size, length), tokenizer.pad_token_id)
        labels, attention = torch.full_like(ids, -100), torch.zeros_like(ids)
        for i, (prompt, response, mask) in enumerate(batch):
            ids[i, : len(prompt) + len(response)] = torch.tensor(prompt + response)
            attention[i, : len(prompt) + len(response)] = 1
            labels[i, len(prompt): len(prompt) + len(response)] = torch.tensor(
                [t if m else -100 for t, m in zip(response, mask)])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return model.eval(), tokenizer, losses


@torch.no_grad()
def first_turns(model, tokenizer, rows, **sampling):
    """The first turns on `rows`: (the share that call the calculator, the accuracy of those that answer at once)."""
    call_end = tokenizer.encode(CALL.split("{}")[1], add_special_tokens=False)[0]
    prompts = [prompt_ids(tokenizer, row) for row in rows]
    length = max(map(len, prompts))
    ids = torch.tensor([[tokenizer.pad_token_id] * (length - len(p)) + p for p in prompts])
    attention = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts])
    out = model.generate(ids, attention_mask=attention, max_new_tokens=16, eos_token_id=[tokenizer.eos_token_id,
                         call_end], pad_token_id=tokenizer.pad_token_id, top_k=0, top_p=1.0, **sampling)
    calls = right = 0
    for row, turn in zip(rows, out[:, length:].tolist()):
        if call_end in turn:
            calls += 1
        else:
            numbers = re.findall(r"-?\d+", tokenizer.decode(turn, skip_special_tokens=True))
            right += bool(numbers) and numbers[-1] == row["answer"]
    return calls / len(rows), right / max(len(rows) - calls, 1)


def run(sft, seed, sync, extra):
    """One grpo_tools_vllm.py run (`extra`: arguments after RUN's): its metrics.jsonl rows and seconds."""
    with tempfile.TemporaryDirectory() as out:
        started = time.time()
        result = subprocess.run([sys.executable, "grpo_tools_vllm.py", *RUN, "--sft-model-path", sft, "--seed",
                                 str(seed), "--output-dir", out, *(["--sync"] if sync else []), *extra], cwd=ROOT,
                                capture_output=True, text=True,
                                env={**os.environ, "HF_HUB_OFFLINE": "1", "WANDB_MODE": "offline"})
        seconds = time.time() - started
        if result.returncode != 0:
            sys.exit(f"seed {seed} {'--sync' if sync else 'async'}: exit {result.returncode}\n{result.stderr[-3000:]}")
        (run_dir,) = [os.path.join(out, d) for d in os.listdir(out)]
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f], seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sft-dir", default=os.path.join(ROOT, "runs", "smollm2_tools_sft"),
                        help="where the SFT policy is written (rebuilt every time)")
    parser.add_argument("--sft-steps", type=int, default=48)
    parser.add_argument("--sft-batch-size", type=int, default=8)
    parser.add_argument("--sft-learning-rate", type=float, default=5e-5)
    parser.add_argument("--sft-from", help="an SFT policy this script built before: skip the SFT, run on it")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--modes", nargs="+", choices=["async", "sync"], default=["async", "sync"])
    parser.add_argument("--extra", default="", help="arguments added to every run's (a later one overrides RUN's)")
    args = parser.parse_args()
    start()
    extra = shlex.split(args.extra)
    print(f"# grpo_tools_vllm.py {shlex.join(RUN + extra)} --sft-model-path <sft> --seed <seed> [--sync]")
    if args.sft_from:
        print(f"sft: {args.sft_from}, built before", flush=True)
        run_all(args.sft_from, args.seeds, args.modes, extra)
        return
    started = time.time()
    model, tokenizer, losses = build_sft(args.sft_dir, args.sft_steps, args.sft_batch_size, args.sft_learning_rate, 0)
    seconds = time.time() - started
    test = read_rows("test")[:64]
    greedy = first_turns(model, tokenizer, test, do_sample=False)
    torch.manual_seed(0)
    sampled = first_turns(model, tokenizer, test, do_sample=True, temperature=0.7)
    print(f"sft: {args.sft_steps} steps of {args.sft_batch_size} demonstrations ({TOOL_SHARE:.0%} with a call) at "
          f"{args.sft_learning_rate:g}, {seconds:.0f} s; loss {losses[0]:.3f} -> {sum(losses[-8:]) / 8:.3f} "
          f"(mean of the last 8); on 64 held-out prompts the first turn calls the calculator in {greedy[0]:.3f} "
          f"(greedy), {sampled[0]:.3f} (sampled at 0.7), and answers at once rightly in {greedy[1]:.3f}, "
          f"{sampled[1]:.3f} of the others", flush=True)
    del model
    run_all(args.sft_dir, args.seeds, args.modes, extra)


def run_all(sft, seeds, modes, extra):
    print("figures per update: " + ", ".join(FIGURES) + "; eval: eval/scores (greedy accuracy on 64 held-out "
          "problems)")
    for seed in seeds:
        for sync in [mode == "sync" for mode in modes]:
            rows, seconds = run(sft, seed, sync, extra)
            name = f"seed {seed} {'--sync' if sync else 'async (K = 1)'}"
            evals = " ".join(f"{row['update']}:{row['eval/scores']:.3f}" for row in rows if "eval/scores" in row)
            print(f"{name}: held-out accuracy by update {evals}; {seconds:.0f} s")
            for row in rows:
                if "tools/tool_rate" in row:
                    print(f"  update {row['update']:2d} " + " ".join(f"{row[key]:.3f}" for key in FIGURES), flush=True)


if __name__ == "__main__":
    main()
