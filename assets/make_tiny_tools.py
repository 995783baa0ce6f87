"""Build the offline tool task in `assets/tiny_tools/` from nothing, deterministically.

Products of two two-digit numbers, which the tiny policy cannot compute in its head (sums of two two-digit numbers
and products by one digit it learns to 80 % from the same references), and a calculator it can call
(grpo_tools_vllm.py's environment). An episode is a list of turns:

    Question: What is 47 * 38?\\n                      the prompt
    <calc>47*38</calc>                                 the policy calls the calculator (a turn ends at </calc>)
    <result>1786</result>                              the environment appends the result
    \\nAnswer: 1786<eos>                               the policy's final answer (a turn ends at the stop token)

or, without the tool, `Answer: 1786<eos>` at once. The SFT references call the tool in TOOL_SHARE of the problems and
answer in their head in the others, rightly; the policy fails most of those, so the RL task is to call the tool more
often (the reward: 1 when the last number of the final turn is the answer). The tokenizer splits numbers into digits
and has `<calc>`, `</calc>`, `<result>` and `</result>` as tokens of their own; every segment of a demonstration is
tokenized on its own, as the environment and vLLM produce them. Train and test use disjoint (a, b, operation).

    python assets/make_tiny_tools.py            # rebuild assets/tiny_tools (a few minutes on 2 cores)
    python assets/make_tiny_tools.py --quick    # a smaller build into a temporary directory
"""

import argparse
import json
import os
import random
import re
import shutil
import tempfile
import time

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GPTNeoXForCausalLM, PreTrainedTokenizerFast

from make_tiny import EOS, PAD, model_config, optimizer_and_schedule, pad_right, train_step

TOOL_TOKENS = ["<calc>", "</calc>", "<result>", "</result>"]
TOOL_SHARE = 0.3  # share of the SFT references that call the calculator


def make_problem(a, b, op):
    return {"query": f"Question: What is {a} {op} {b}?\n", "answer": str(a + b if op == "+" else a * b),
            "operation": f"{a} {op} {b}"}


def demonstration(problem, tool):
    """The reference's segments: (text, whether the policy wrote it), the stop token after the last."""
    a, op, b = problem["operation"].split()
    if not tool:
        return [("Answer: " + problem["answer"], True)]
    return [(f"<calc>{a}{op}{b}</calc>", True), (f"<result>{problem['answer']}</result>", False),
            ("\nAnswer: " + problem["answer"], True)]


def build_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[EOS, PAD, *TOOL_TOKENS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def encode(tokenizer, problem, segments):
    """Prompt ids, response ids and the response's loss mask (1 where the policy wrote the token)."""
    ids, mask = [], []
    for text, policy in segments:
        segment = tokenizer.encode(text)
        ids, mask = ids + segment, mask + [int(policy)] * len(segment)
    return tokenizer.encode(problem["query"]), ids + [tokenizer.eos_token_id], mask + [1]


def train_sft(tokenizer, examples, steps, batch_size, seed, log):
    """Next-token loss on the policy's tokens only: the environment's result is read, never imitated."""
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(model_config(tokenizer))
    opt, sched = optimizer_and_schedule(model, 2e-3, steps)
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(len(examples), (batch_size,), generator=g).tolist()
        ids, attention = pad_right([examples[i][0] + examples[i][1] for i in idx], tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        for row, i in enumerate(idx):
            query, response, mask = examples[i]
            labels[row, len(query): len(query) + len(response)] = torch.tensor(
                [token if m else -100 for token, m in zip(response, mask)])
        loss = model(input_ids=ids, attention_mask=attention, labels=labels).loss
        train_step(model, opt, sched, loss, step, steps, log, "sft loss")
    return model.eval()


@torch.no_grad()
def first_turns(model, tokenizer, problems, max_new_tokens=12, **sampling):
    """First turns, greedy or sampled: (the share that calls the tool, the accuracy of those that answer at once)."""
    calls, right, direct = 0, 0, 0
    calc_end = tokenizer.convert_tokens_to_ids("</calc>")
    for problem in problems:
        ids = torch.tensor([tokenizer.encode(problem["query"])])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, top_k=0,
                             eos_token_id=[tokenizer.eos_token_id, calc_end], pad_token_id=tokenizer.pad_token_id,
                             **sampling)
        turn = out[0, ids.shape[1]:].tolist()
        if calc_end in turn:
            calls += 1
        else:
            direct += 1
            numbers = re.findall(r"-?\d+", tokenizer.decode(turn, skip_special_tokens=True))
            right += bool(numbers) and numbers[-1] == problem["answer"]
    return calls / len(problems), right / max(direct, 1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small build into a temporary directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1000, help="SFT steps")
    args = parser.parse_args()
    out = tempfile.mkdtemp() if args.quick else os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_tools")
    steps = 100 if args.quick else args.steps
    start, lines = time.time(), []

    def log(message):
        lines.append(f"[{time.time() - start:7.1f}s] {message}")
        print(lines[-1], flush=True)

    rng = random.Random(args.seed)
    triples = [(a, b, "*") for a in range(11, 100) for b in range(11, 100)]
    rng.shuffle(triples)
    test_triples, train_triples = triples[:256], triples[256:]
    train = [make_problem(*rng.choice(train_triples)) for _ in range(20000)]
    test = [make_problem(*triple) for triple in test_triples]
    demos = [demonstration(p, rng.random() < TOOL_SHARE) for p in train]
    tokenizer = build_tokenizer([p["query"] + "".join(text for text, _ in d) for p, d in zip(train, demos)])
    log(f"tokenizer: {len(tokenizer)} tokens; {len(train)} train problems, {len(test)} test problems")
    examples = [encode(tokenizer, p, d) for p, d in zip(train, demos)]
    model = train_sft(tokenizer, examples, steps, 256, args.seed, log)
    tool_rate, direct_accuracy = first_turns(model, tokenizer, test, do_sample=False)
    torch.manual_seed(args.seed)
    sampled_rate, sampled_accuracy = first_turns(model, tokenizer, test, do_sample=True, temperature=0.7)
    log(f"sft on the test problems: calls the tool in {tool_rate:.3f} greedy, {sampled_rate:.3f} sampled at 0.7; "
        f"answers at once rightly in {direct_accuracy:.3f} (greedy), {sampled_accuracy:.3f} (sampled) of the others")

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "data"))
    model.save_pretrained(os.path.join(out, "sft"))
    tokenizer.save_pretrained(os.path.join(out, "sft"))
    for name, problems in (("train", train), ("test", test)):
        with open(os.path.join(out, "data", f"{name}.jsonl"), "w") as f:
            for p in problems:
                f.write(json.dumps(p) + "\n")
    stats = {"seed": args.seed, "sft_steps": steps, "build_seconds": round(time.time() - start, 1),
             "tool_share_of_references": TOOL_SHARE, "sft_greedy_tool_rate": tool_rate,
             "sft_greedy_direct_accuracy": direct_accuracy, "sft_sampled_tool_rate": sampled_rate,
             "sft_sampled_direct_accuracy": sampled_accuracy}
    with open(os.path.join(out, "build_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"""# The tiny tool task

Built by `python assets/make_tiny_tools.py{' --quick' if args.quick else ''}` (seed {args.seed}) in
{stats['build_seconds'] / 60:.1f} minutes on 2 CPU cores. Do not edit by hand: rebuild instead.

- `sft/`: the SFT policy (GPT-NeoX, hidden 128, 2 layers, 2 heads of 64) and its tokenizer (digits are single
  tokens; `<calc>`, `</calc>`, `<result>`, `</result>` are tokens of their own).
- `data/train.jsonl`, `data/test.jsonl`: `query` (`Question: What is a * b?` and a newline), `answer` and
  `operation` columns; products of two two-digit numbers; train and test use disjoint (a, b) pairs.

The references call the calculator in {TOOL_SHARE:.0%} of the problems (`<calc>47*38</calc>`, then the environment's
`<result>1786</result>`, then `\\nAnswer: 1786`) and answer at once in the others. grpo_tools_vllm.py trains on it with
`--rule-reward last_number` (1 when the last number of the final turn is `answer`).

| SFT policy on the {len(test)} test problems, first turn | greedy | sampled at temperature 0.7 |
|---|---|---|
| calls the calculator | {tool_rate:.3f} | {sampled_rate:.3f} |
| answers at once, rightly (of those that do) | {direct_accuracy:.3f} | {sampled_accuracy:.3f} |

## Build log

```
""" + "\n".join(lines) + "\n```\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
