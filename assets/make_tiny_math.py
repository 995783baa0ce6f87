"""Build the offline math task in `assets/tiny_math/` from nothing, deterministically.

A miniature of the paper's GSM8K experiment: short word problems of two-digit arithmetic, a
rule-based reward that checks the final answer, and an SFT policy that solves about half of
them. A problem adds or subtracts a one-digit number to or from a two-digit one:

    Question: Ann has 47 apples. She buys 8 more. How many apples does Ann have now?
    Answer: 55<eos>

The SFT references make the commonest mistake of people learning arithmetic: in 60 % of the
problems that need a carry (47 + 8) or a borrow (52 - 7) they forget it (47 + 8 -> 45). The SFT
policy therefore answers those problems wrongly when decoding greedily and correctly in some of
its samples, which is the headroom that RL with the rule reward (1 if the last number of the
response equals the answer, else 0) removes. Train and test problems use disjoint pairs of
numbers, so the test measures arithmetic, not memory.

The tokenizer splits numbers into digits (as Llama's does), so the policy computes the answer
digit by digit. The model is the tiny task's GPT-NeoX (hidden 128, 2 layers, 2 heads of 64).

    python assets/make_tiny_math.py            # rebuild assets/tiny_math (a few minutes on 2 cores)
    python assets/make_tiny_math.py --quick    # a smaller build into a temporary directory
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

from make_tiny import EOS, PAD, model_config, optimizer_and_schedule, pad_right, sample, train_step

NAMES = {"Ann": "She", "Ben": "He", "Cara": "She", "Dan": "He", "Eva": "She", "Finn": "He", "Gus": "He",
         "Hana": "She", "Ivan": "He", "Jo": "She"}
OBJECTS = "apples pens cards coins stamps books marbles shells stickers cookies".split()
ADD = ["{name} has {a} {obj}. {pron} buys {b} more. How many {obj} does {name} have now?",
       "{name} had {a} {obj} and found {b} more. How many {obj} does {name} have?",
       "There are {a} {obj} in a box. {name} puts in {b} more. How many {obj} are in the box?"]
SUB = ["{name} has {a} {obj}. {pron} gives {b} away. How many {obj} does {name} have now?",
       "{name} had {a} {obj} and lost {b} of them. How many {obj} are left?",
       "There are {a} {obj} in a box. {name} takes out {b}. How many {obj} are in the box?"]
FORGET_CARRY = 0.6  # share of carry/borrow problems whose SFT reference forgets it
PROMPT_SUFFIX = "\nAnswer:"


def make_problem(rng, a, b, op):
    name = rng.choice(sorted(NAMES))
    template = rng.choice(ADD if op == "+" else SUB)
    text = template.format(name=name, pron=NAMES[name], a=a, b=b, obj=rng.choice(OBJECTS))
    answer = a + b if op == "+" else a - b
    return {"query": "Question: " + text + PROMPT_SUFFIX, "answer": str(answer), "operation": f"{a} {op} {b}"}


def needs_carry(a, b, op):
    return a % 10 + b >= 10 if op == "+" else a % 10 < b


def sft_answer(rng, a, b, op):
    """The reference: the right answer, or (FORGET_CARRY of the time) the one that forgets the carry or borrow."""
    if needs_carry(a, b, op) and rng.random() < FORGET_CARRY:
        return a // 10 * 10 + (a % 10 + b) % 10 if op == "+" else a // 10 * 10 + (a % 10 - b) % 10
    return a + b if op == "+" else a - b


def last_number(text):
    numbers = re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def build_tokenizer(corpus):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=[EOS, PAD],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)


def train_sft(tokenizer, examples, steps, batch_size, seed, log):
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(model_config(tokenizer))
    opt, sched = optimizer_and_schedule(model, 2e-3, steps)
    q_ids = [tokenizer.encode(q) for q, _ in examples]
    r_ids = [tokenizer.encode(" " + r) + [tokenizer.eos_token_id] for _, r in examples]
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        idx = torch.randint(len(q_ids), (batch_size,), generator=g).tolist()
        ids, mask = pad_right([q_ids[i] + r_ids[i] for i in idx], tokenizer.pad_token_id)
        labels = torch.full_like(ids, -100)
        for row, i in enumerate(idx):
            labels[row, len(q_ids[i]): len(q_ids[i]) + len(r_ids[i])] = torch.tensor(r_ids[i])
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        train_step(model, opt, sched, loss, step, steps, log, "sft loss")
    return model.eval()


def accuracy(model, tokenizer, problems, **sampling):
    responses = sample(model, tokenizer, [p["query"] for p in problems], max_new_tokens=6, **sampling)
    return sum(last_number(r) == p["answer"] for (r, _), p in zip(responses, problems)) / len(problems)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small build into a temporary directory")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=1500, help="SFT steps")
    args = parser.parse_args()
    out = tempfile.mkdtemp() if args.quick else os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_math")
    steps = 100 if args.quick else args.steps
    start, lines = time.time(), []

    def log(message):
        lines.append(f"[{time.time() - start:7.1f}s] {message}")
        print(lines[-1], flush=True)

    rng = random.Random(args.seed)
    pairs = [(a, b, op) for a in range(10, 100) for b in range(2, 10) for op in "+-"]
    rng.shuffle(pairs)
    test_pairs, train_pairs = pairs[:288], pairs[288:]  # disjoint: 20 % of the 1440 (a, b, op) for test
    train_draws = [rng.choice(train_pairs) for _ in range(20000)]
    train = [make_problem(rng, *pair) for pair in train_draws]
    test = [make_problem(rng, *pair) for pair in test_pairs]
    references = [(p["query"], str(sft_answer(rng, *pair))) for p, pair in zip(train, train_draws)]
    tokenizer = build_tokenizer([p["query"] + " " + p["answer"] for p in train])
    log(f"tokenizer: {len(tokenizer)} tokens; {len(train)} train problems, {len(test)} test problems")
    model = train_sft(tokenizer, references, steps, 256, args.seed, log)
    greedy = accuracy(model, tokenizer, test, temperature=None, greedy=True)
    sampled = accuracy(model, tokenizer, test, temperature=0.7)
    carry = [p for p, pair in zip(test, test_pairs) if needs_carry(*pair)]
    greedy_carry = accuracy(model, tokenizer, carry, temperature=None, greedy=True)
    sampled_carry = accuracy(model, tokenizer, carry, temperature=0.7)
    log(f"sft test accuracy: greedy {greedy:.3f}, sampled at 0.7 {sampled:.3f}; on the {len(carry)} carry/borrow "
        f"problems greedy {greedy_carry:.3f}, sampled {sampled_carry:.3f}")

    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.join(out, "data"))
    model.save_pretrained(os.path.join(out, "sft"))
    tokenizer.save_pretrained(os.path.join(out, "sft"))
    for name, problems in (("train", train), ("test", test)):
        with open(os.path.join(out, "data", f"{name}.jsonl"), "w") as f:
            for p in problems:
                f.write(json.dumps(p) + "\n")
    stats = {"seed": args.seed, "sft_steps": steps, "build_seconds": round(time.time() - start, 1),
             "sft_greedy_accuracy": greedy, "sft_sampled_accuracy": sampled,
             "carry_problems": len(carry), "sft_greedy_accuracy_carry": greedy_carry,
             "sft_sampled_accuracy_carry": sampled_carry}
    with open(os.path.join(out, "build_stats.json"), "w") as f:
        json.dump(stats, f, indent=1)
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(f"""# The tiny math task

Built by `python assets/make_tiny_math.py{' --quick' if args.quick else ''}` (seed {args.seed}) in
{stats['build_seconds'] / 60:.1f} minutes on 2 CPU cores. Do not edit by hand: rebuild instead.

- `sft/`: the SFT policy (GPT-NeoX, hidden 128, 2 layers, 2 heads of 64) and its tokenizer (digits are
  single tokens).
- `data/train.jsonl`, `data/test.jsonl`: `query` (the prompt, ending in `Answer:`), `answer` (the number)
  and `operation` columns; train and test use disjoint (a, b, operation) triples.

There is no reward model: the scripts score with `--rule-reward last_number` (1 when the last number
in the response equals `answer`, else 0). How problems and references are drawn is in
`assets/make_tiny_math.py`.

| SFT policy on the {len(test)} test problems | greedy | sampled at temperature 0.7 |
|---|---|---|
| accuracy, all problems | {greedy:.3f} | {sampled:.3f} |
| accuracy, the {len(carry)} problems with a carry or borrow | {greedy_carry:.3f} | {sampled_carry:.3f} |

## Build log

```
""" + "\n".join(lines) + "\n```\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
