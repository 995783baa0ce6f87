"""Build the offline tiny task in `assets/tiny/` from nothing, deterministically.

The task is a miniature of the paper's TL;DR pipeline. A prompt names a subreddit (one of eight
topics) and a "post": a bag of words from that topic (3-6 distinct words, some repeated), a
distractor topic (1-2 words) and filler words. A good "TL;DR" names words of the subreddit's
topic, five of them at most, and stops:

    gold = +0.2 per word of the subreddit's topic, -0.2 per other word,
           -0.3 more per word after the fifth, -0.5 when the response has no EOS

The reference summaries mostly name one to three topic words (rarely four or five) and
sometimes a wrong word, so the SFT policy (~0.35 gold) leaves headroom up to 1.0, and it can
still sample the longer answers that RL needs to find. (With references of at most two topic
words, RL stalled at three-word answers: after three words the SFT policy never continued.) (A first version scored words by whether
they appear in the post and belong to its most frequent topic; 2-layer reward models never
learned those token-matching relations in this budget and plateaued at 0.72 pairwise accuracy.
The subreddit makes the topic one distinctive token to attend to.) The build follows the
paper's protocol:

1. a byte-level BPE tokenizer (every word of the task is one token) with a small chat template;
2. an SFT policy (GPT-NeoX, hidden 128, 2 layers, 2 heads of 64) trained on the references;
3. a *gold* reward model, initialised from the SFT policy and regressed (MSE) on the gold
   function at every response token (the score after token j is trained towards the gold score
   of the response cut there), over SFT samples at three temperatures and synthetic responses
   of every length: answers of 1-8 topic words, wrong words, repeats, no EOS;
4. a *proxy* reward model, initialised from the SFT policy and trained Bradley-Terry with soft
   labels on pairs of responses to other prompts, labelled by the gold reward model; its scores
   are scaled to unit standard deviation on SFT samples;
5. JSONL train/test prompts (`query`, `reference_response`) that `datasets` loads, and a small chat-formatted
   variant of them (`chat_data/`, a `messages` column).

    python assets/make_tiny.py            # rebuild assets/tiny (about 11 minutes on 2 cores)
    python assets/make_tiny.py --quick    # a smaller build into a temporary directory
"""

import argparse
import json
import math
import os
import random
import shutil
import tempfile
import time

import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    GPTNeoXForSequenceClassification,
    PreTrainedTokenizerFast,
)

TOPICS = {
    "food": "bread apple soup cheese rice pasta salad cake pizza butter honey noodle",
    "sport": "ball goal team match coach score race tennis soccer player stadium referee",
    "music": "song guitar drum piano concert band melody singer violin chorus album rhythm",
    "weather": "rain storm snow wind cloud thunder sunny fog frost breeze hail flood",
    "animals": "dog cat horse rabbit tiger parrot whale monkey turtle lion eagle wolf",
    "travel": "train plane hotel ticket airport luggage beach passport cruise map tour bus",
    "tech": "laptop phone code server robot screen keyboard software chip battery router app",
    "school": "teacher exam homework class lesson pencil library student grade chalk essay campus",
}
TOPICS = {name: words.split() for name, words in TOPICS.items()}
TOPIC_OF = {w: name for name, words in TOPICS.items() for w in words}
FILLER = ("the a and so very my we it was really just then after with about some our got went "
          "saw had new big today").split()
ALL_WORDS = sorted(TOPIC_OF) + FILLER
EOS, PAD = "<|endoftext|>", "<|padding|>"
SUBREDDIT, PROMPT_PREFIX, PROMPT_SUFFIX = "SUBREDDIT: r/", "\nPOST:", "\nTL;DR:"
# A small chat template, so that chat-formatted (`messages`) datasets can be tested: "USER: ...\nASSISTANT:".
CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] | upper }}: {{ message['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


# ----------------------------------------------------------------------------- the task
def make_post(rng):
    """Words of one post: main topic, distractor topic and filler, shuffled."""
    main, other = rng.sample(sorted(TOPICS), 2)
    main_words = rng.sample(TOPICS[main], rng.randint(3, 6))
    words = main_words + rng.sample(main_words, rng.randint(0, 2))  # some main words twice
    words += rng.sample(TOPICS[other], rng.randint(1, 2)) + rng.choices(FILLER, k=rng.randint(8, 14))
    rng.shuffle(words)
    return words, main


def make_reference(rng, post_words, main):
    """A human-like but imperfect TL;DR: mostly one to three topic words of the post, now and
    then four or five (so the SFT policy can still sample longer answers), sometimes a wrong word."""
    main_words = sorted({w for w in post_words if TOPIC_OF.get(w) == main})
    n = rng.choices([1, 2, 3, 4, 5], weights=[35, 30, 18, 10, 7])[0]
    words = rng.sample(main_words, min(n, len(main_words)))
    if rng.random() < 0.3:
        words.insert(rng.randint(0, len(words)), rng.choice([w for w in post_words if TOPIC_OF.get(w) != main]))
    return words


def query_text(post_words, topic):
    return SUBREDDIT + topic + PROMPT_PREFIX + "".join(" " + w for w in post_words) + PROMPT_SUFFIX


def topic_of_query(query):
    return query[query.index(SUBREDDIT) + len(SUBREDDIT): query.index(PROMPT_PREFIX)]


def post_words_of(query):
    return query[query.index(PROMPT_PREFIX) + len(PROMPT_PREFIX): query.rindex(PROMPT_SUFFIX)].split()


def gold_score(query, response, has_eos):
    """The programmatic gold score of `response` (text without EOS) to the prompt `query`."""
    topic = topic_of_query(query)
    score = 0.0
    for i, w in enumerate(response.split()):
        score += 0.2 if TOPIC_OF.get(w) == topic else -0.2
        score -= 0.3 if i >= 5 else 0.0
    return score - (0.0 if has_eos else 0.5)


def synthetic_response(rng, post_words, main):
    """A response from a broad mix: answers of every length (so that the reward models learn to
    count topic words beyond the one or two of the references), wrong words, repeats, no EOS."""
    in_post = sorted({w for w in post_words if TOPIC_OF.get(w) == main})
    others = [w for w in ALL_WORDS if TOPIC_OF.get(w) != main]
    if rng.random() < 0.5:  # n topic words, sometimes with one wrong word among them
        words = rng.sample(TOPICS[main], rng.randint(1, 8))
        if rng.random() < 0.4:
            words.insert(rng.randint(0, len(words)), rng.choice(others))
        return words, rng.random() > 0.05
    has_eos = rng.random() > 0.1
    words = []
    for _ in range(rng.randint(0, 8) if has_eos else rng.randint(1, 16)):
        kind = rng.random()
        if kind < 0.35:
            words.append(rng.choice(in_post))
        elif kind < 0.55:
            words.append(rng.choice(TOPICS[main]))
        elif kind < 0.85 or not words:
            words.append(rng.choice(others))
        else:
            words.append(rng.choice(words))
    return words, has_eos


# ----------------------------------------------------------------------------- tokenizer
def build_tokenizer(posts_and_refs):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024, special_tokens=[EOS, PAD], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [query_text(p, m) + " " + " ".join(r) for (p, m), r in posts_and_refs]
    corpus += [SUBREDDIT + t for t in TOPICS] * 50
    corpus += [" " + " ".join(ALL_WORDS)] * 50  # every word is seen often enough to merge
    tok.train_from_iterator(corpus, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, pad_token=PAD)
    tokenizer.chat_template = CHAT_TEMPLATE
    for w in ALL_WORDS:
        assert len(tokenizer.encode(" " + w)) == 1, f"word {w!r} is not one token"
    return tokenizer


# ----------------------------------------------------------------------------- models
def model_config(tokenizer):
    return GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=128, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=512, max_position_embeddings=128, rotary_pct=0.25,
        hidden_dropout=0.0, attention_dropout=0.0, tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, num_labels=1,
    )


def pad_right(seqs, pad_id):
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
    return ids, ids != pad_id


def optimizer_and_schedule(model, lr, steps, warmup=50):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    return opt, sched


def train_step(model, opt, sched, loss, step, steps, log, what):
    """Backward, clip, optimizer and schedule step; log `what` every 250 steps and at the end."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step(), sched.step(), opt.zero_grad()
    if step % 250 == 0 or step == steps - 1:
        log(f"  step {step:5d} {what} {loss.item():.4f}")


def train_sft(tokenizer, queries, references, steps, batch_size, seed, log):
    torch.manual_seed(seed)
    model = GPTNeoXForCausalLM(model_config(tokenizer))
    opt, sched = optimizer_and_schedule(model, 2e-3, steps)
    q_ids = [tokenizer.encode(q) for q in queries]
    r_ids = [tokenizer.encode("".join(" " + w for w in r)) + [tokenizer.eos_token_id] for r in references]
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


@torch.no_grad()
def sample(model, tokenizer, queries, temperature, max_new_tokens=12, batch_size=512, greedy=False):
    """Responses (text without EOS, has_eos) sampled from the policy."""
    out = []
    tokenizer.padding_side = "left"
    for start in range(0, len(queries), batch_size):
        enc = tokenizer(queries[start: start + batch_size], return_tensors="pt", padding=True)
        gen = model.generate(
            **enc, max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
            **(dict(do_sample=False) if greedy else dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)),
        )[:, enc.input_ids.shape[1]:]
        for row in gen.tolist():
            has_eos = tokenizer.eos_token_id in row
            if has_eos:
                row = row[: row.index(tokenizer.eos_token_id)]
            out.append((tokenizer.decode([t for t in row if t != tokenizer.pad_token_id]), has_eos))
    return out


def response_ids(tokenizer, text, has_eos):
    return tokenizer.encode(text) + ([tokenizer.eos_token_id] if has_eos else [])


def rm_from_sft(sft, tokenizer, seed):
    torch.manual_seed(seed)
    rm = GPTNeoXForSequenceClassification(model_config(tokenizer))
    rm.gpt_neox.load_state_dict(sft.gpt_neox.state_dict())
    torch.nn.init.normal_(rm.score.weight, std=1e-3)
    return rm


@torch.no_grad()
def rm_scores(rm, tokenizer, examples, batch_size=1024):
    """Reward-model scores of (query, response text, has_eos) triples."""
    out = []
    for start in range(0, len(examples), batch_size):
        batch = examples[start: start + batch_size]
        ids, mask = pad_right([tokenizer.encode(q) + response_ids(tokenizer, r, e) for q, r, e in batch],
                              tokenizer.pad_token_id)
        out.append(rm(input_ids=ids, attention_mask=mask).logits[:, 0])
    return torch.cat(out)


def prefix_targets(tokenizer, query, text, has_eos):
    """Token ids of a response and the gold score of every prefix of it, read as a whole response."""
    ids = response_ids(tokenizer, text, has_eos)
    targets = [gold_score(query, tokenizer.decode(ids[: j + 1]), False) for j in range(len(ids) - has_eos)]
    return ids, targets + ([gold_score(query, text, True)] if has_eos else [])


def train_gold_rm(sft, tokenizer, examples, steps, batch_size, seed, log):
    """MSE regression of the gold function, at every response token: the score read after token j
    is trained towards the gold score of the response cut after token j. The last token carries
    the whole response's score, as AutoModelForSequenceClassification reads it; the earlier tokens
    give many more targets per sequence, which a small model needs to learn the sum."""
    rm = rm_from_sft(sft, tokenizer, seed)
    opt, sched = optimizer_and_schedule(rm, 1e-3, steps)
    data = [(tokenizer.encode(q), *prefix_targets(tokenizer, q, r, e)) for q, r, e in examples]
    g = torch.Generator().manual_seed(seed)
    for step in range(steps):
        batch = [data[i] for i in torch.randint(len(data), (batch_size,), generator=g).tolist()]
        ids, mask = pad_right([q + r for q, r, _ in batch], tokenizer.pad_token_id)
        targets = torch.full(ids.shape, float("nan"))
        for row, (q, r, t) in enumerate(batch):
            targets[row, len(q): len(q) + len(r)] = torch.tensor(t)
        scores = token_scores(rm, ids, mask)
        has_target = ~targets.isnan()
        last = mask.sum(1) - 1
        rows = torch.arange(len(batch))
        loss = F.mse_loss(scores[has_target], targets[has_target]) + F.mse_loss(scores[rows, last], targets[rows, last])
        train_step(rm, opt, sched, loss, step, steps, log, "gold rm mse (all prefixes + whole)")
    return rm.eval()


def token_scores(rm, ids, mask):
    """The reward model's score read at every position (the last one is its usual output)."""
    return rm.score(rm.gpt_neox(input_ids=ids, attention_mask=mask).last_hidden_state)[..., 0]


def response_token_scores(rm, tokenizer, query, responses):
    """Scores after every token of each response to one query, NaN-padded: (len(responses), 32)."""
    q = tokenizer.encode(query)
    seqs = [q + response_ids(tokenizer, *r) for r in responses]
    ids, mask = pad_right(seqs, tokenizer.pad_token_id)
    out = torch.full((len(seqs), 32), float("nan"))
    with torch.no_grad():
        scores = token_scores(rm, ids, mask)
    for i, s in enumerate(seqs):
        out[i, : len(s) - len(q)] = scores[i, len(q): len(s)]
    return out


def train_proxy_rm(sft, tokenizer, groups, gold, steps, batch_size, seed, log):
    """Bradley-Terry with soft labels P(a > b) = sigmoid((gold_rm(a) - gold_rm(b)) / 0.1) over all
    six pairs of each prompt's four responses (one forward pass scores all four). As for the gold
    RM, the pairs are compared at the end of the responses and also cut after every common length."""
    rm = rm_from_sft(sft, tokenizer, seed + 1)
    opt, sched = optimizer_and_schedule(rm, 1e-3, steps)
    g = torch.Generator().manual_seed(seed + 1)
    first, second = torch.triu_indices(4, 4, offset=1)
    for step in range(steps):
        idx = torch.randint(len(groups), (batch_size,), generator=g).tolist()
        seqs = [tokenizer.encode(groups[i][0]) + response_ids(tokenizer, *r) for i in idx for r in groups[i][1]]
        ids, mask = pad_right(seqs, tokenizer.pad_token_id)
        scores = token_scores(rm, ids, mask)
        # Each response's scores after each of its tokens, NaN-padded like `gold`.
        r = torch.zeros(len(seqs), gold.shape[-1])
        q_len = [len(tokenizer.encode(groups[i][0])) for i in idx for _ in range(4)]
        for row, (s, q) in enumerate(zip(seqs, q_len)):
            r[row, : len(s) - q] = scores[row, q: len(s)]
        r, target = r.view(batch_size, 4, -1), gold[idx]
        valid = ~(target[:, first].isnan() | target[:, second].isnan())
        labels = torch.sigmoid((target[:, first] - target[:, second]) / 0.1)
        prefix_terms = F.binary_cross_entropy_with_logits((r[:, first] - r[:, second])[valid], labels[valid])
        last = mask.sum(1) - 1
        final = scores[torch.arange(len(seqs)), last].view(batch_size, 4)
        lengths = (~target.isnan()).sum(-1)
        final_gold = target.gather(-1, (lengths - 1).unsqueeze(-1))[..., 0]
        final_labels = torch.sigmoid((final_gold[:, first] - final_gold[:, second]) / 0.1)
        # Soft-label BT, plus a small pull of the scores towards zero so that they stay centred.
        loss = prefix_terms + F.binary_cross_entropy_with_logits(final[:, first] - final[:, second], final_labels)
        loss = loss + 1e-3 * (final ** 2).mean()
        train_step(rm, opt, sched, loss, step, steps, log, "proxy rm loss (prefix pairs + whole pairs)")
    return rm.eval()


def pairwise_accuracy(rm, tokenizer, pairs):
    """Share of pairs with different gold scores that the reward model orders like gold."""
    pairs = [p for p in pairs if abs(gold_score(p[0], *p[1]) - gold_score(p[0], *p[2])) > 1e-6]
    a = rm_scores(rm, tokenizer, [(q, *x) for q, x, _ in pairs])
    b = rm_scores(rm, tokenizer, [(q, *y) for q, _, y in pairs])
    gold = torch.tensor([gold_score(q, *x) - gold_score(q, *y) for q, x, y in pairs])
    return ((a - b).sign() == gold.sign()).float().mean().item(), len(pairs)


# ----------------------------------------------------------------------------- the build
def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small build into a temporary directory")
    parser.add_argument("--out", default=None, help="output directory (default assets/tiny)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = args.out or (tempfile.mkdtemp(prefix="tiny_") if args.quick else
                       os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny"))
    n = dict(train=4000, test=500, sft_steps=100, gold=3000, gold_steps=100, proxy=3000, proxy_steps=50) \
        if args.quick else \
        dict(train=40000, test=2000, sft_steps=1500, gold=120000, gold_steps=4000, proxy=48000, proxy_steps=1500)
    start, lines = time.time(), []

    def log(msg):
        msg = f"[{time.time() - start:6.1f}s] {msg}"
        print(msg, flush=True)
        lines.append(msg)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    posts = [make_post(rng) for _ in range(n["train"] + n["test"])]
    refs = [make_reference(rng, p, m) for p, m in posts]
    queries = [query_text(p, m) for p, m in posts]
    tokenizer = build_tokenizer(list(zip(posts, refs)))
    log(f"tokenizer: {len(tokenizer)} tokens")

    # Three disjoint prompt sets: SFT + gold RM, proxy RM, and the held-out test split.
    train, test = range(n["train"]), range(n["train"], n["train"] + n["test"])
    sft = train_sft(tokenizer, [queries[i] for i in train], [refs[i] for i in train], n["sft_steps"], 64,
                    args.seed, log)
    greedy = sample(sft, tokenizer, [queries[i] for i in test], 1.0, greedy=True)
    copied = sum(w in post_words_of(queries[i]) for i, (r, _) in zip(test, greedy) for w in r.split())
    total = sum(len(r.split()) for r, _ in greedy)
    sft_greedy_gold = sum(gold_score(queries[i], *g) for i, g in zip(test, greedy)) / len(greedy)
    log(f"sft: greedy responses copy {copied / max(total, 1):.3f} of their words from the post; "
        f"greedy gold {sft_greedy_gold:.3f}")

    def response_mix(indices, seed):
        """Four responses per prompt: two SFT samples (temperature 0.7, 1.0 or 1.4 by prompt) and
        two synthetic ones. Returns {query: [(text, has_eos), ...]}."""
        r = random.Random(seed)
        torch.manual_seed(seed)
        mix = {queries[i]: [] for i in indices}
        for k, t in enumerate((0.7, 1.0, 1.4)):
            part = [queries[i] for i in indices[k::3]]
            for q, resp in zip(part * 2, sample(sft, tokenizer, part * 2, t)):
                mix[q].append(resp)
        for i in indices:
            for _ in range(2):
                mix[queries[i]].append(_join(synthetic_response(r, *posts[i])))
        return mix

    def pairs_of(mix, which=((0, 1), (2, 3), (0, 2), (1, 3))):
        return [(q, rs[a], rs[b]) for q, rs in mix.items() for a, b in which]

    half = len(train) // 2
    gold_mix = response_mix(list(range(0, half))[: n["gold"] // 4], args.seed + 10)
    gold_data = [(q, *r) for q, rs in gold_mix.items() for r in rs]
    log(f"gold rm data: {len(gold_data)} responses")
    gold_rm = train_gold_rm(sft, tokenizer, gold_data, n["gold_steps"], 64, args.seed, log)

    # Proxy RM data: responses to other prompts, compared in pairs by the gold RM.
    groups = list(response_mix(list(range(half, len(train)))[: n["proxy"] // 4], args.seed + 20).items())
    gold = torch.stack([response_token_scores(gold_rm, tokenizer, q, rs) for q, rs in groups])
    log(f"proxy rm data: {len(groups)} prompts x 4 responses, 6 pairs each, labelled by the gold rm")
    proxy_rm = train_proxy_rm(sft, tokenizer, groups, gold, n["proxy_steps"], 32, args.seed, log)

    # Scale the proxy so that its scores on SFT samples have unit standard deviation.
    test_list = list(test)
    sft_samples = sample(sft, tokenizer, [queries[i] for i in test_list], 0.7)
    proxy_on_sft = rm_scores(proxy_rm, tokenizer, [(queries[i], *s) for i, s in zip(test_list, sft_samples)])
    proxy_rm.score.weight.data /= proxy_on_sft.std()
    log(f"proxy rm: scores on SFT samples had mean {proxy_on_sft.mean():.3f} std {proxy_on_sft.std():.3f}; "
        "scaled to std 1")

    # Held-out evaluation on test prompts: mixed pairs, and pairs of two SFT samples.
    test_mix = response_mix(test_list, args.seed + 30)
    stats = {}
    for name, rm in (("gold", gold_rm), ("proxy", proxy_rm)):
        stats[name] = pairwise_accuracy(rm, tokenizer, pairs_of(test_mix))
        stats[name + "_sft"] = pairwise_accuracy(rm, tokenizer, pairs_of(test_mix, [(0, 1)]))
        log(f"{name} rm: pairwise accuracy vs gold function {stats[name][0]:.3f} on {stats[name][1]} held-out "
            f"mixed pairs, {stats[name + '_sft'][0]:.3f} on {stats[name + '_sft'][1]} held-out SFT-sample pairs")
    ref_gold = [gold_score(queries[i], " ".join(refs[i]), True) for i in test_list]
    sft_gold = [gold_score(queries[i], *s) for i, s in zip(test_list, sft_samples)]
    best_gold = [1.0 for _ in test_list]
    g_sft = rm_scores(gold_rm, tokenizer, [(queries[i], *s) for i, s in zip(test_list, sft_samples)])
    g_ref = rm_scores(gold_rm, tokenizer, [(queries[i], " ".join(refs[i]), True) for i in test_list])
    win_rate = ((g_sft > g_ref).float() + 0.5 * (g_sft == g_ref).float()).mean().item()
    log(f"gold function on test prompts: references {sum(ref_gold) / len(ref_gold):.3f}, SFT samples (T=0.7) "
        f"{sum(sft_gold) / len(sft_gold):.3f}, SFT greedy {sft_greedy_gold:.3f}, best possible "
        f"{sum(best_gold) / len(best_gold):.3f}; SFT win rate vs references under the gold RM {win_rate:.3f}")

    # Write everything.
    shutil.rmtree(out, ignore_errors=True)
    for name, model in (("sft", sft), ("gold_reward", gold_rm), ("reward", proxy_rm)):
        model.save_pretrained(os.path.join(out, name))
        tokenizer.save_pretrained(os.path.join(out, name))
    os.makedirs(os.path.join(out, "data"))
    # The RL scripts need far fewer prompts than the reward models did: ship 20000 (about 3 MB).
    for split, idx in (("train", train[:20000]), ("test", test)):
        with open(os.path.join(out, "data", f"{split}.jsonl"), "w") as f:
            for i in idx:
                f.write(json.dumps({"query": queries[i], "reference_response": " " + " ".join(refs[i])}) + "\n")
    write_chat_variant(out)
    log(f"wrote {out}")
    summary = {
        "gold_rm_accuracy": stats["gold"][0], "gold_rm_accuracy_sft_pairs": stats["gold_sft"][0],
        "proxy_rm_accuracy": stats["proxy"][0], "proxy_rm_accuracy_sft_pairs": stats["proxy_sft"][0],
        "gold_of_references": sum(ref_gold) / len(ref_gold), "gold_of_sft_samples": sum(sft_gold) / len(sft_gold),
        "gold_of_sft_greedy": sft_greedy_gold, "gold_of_best": sum(best_gold) / len(best_gold),
        "sft_win_rate_vs_references": win_rate, "build_seconds": round(time.time() - start),
    }
    with open(os.path.join(out, "build_stats.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_readme(out, args, stats, lines, time.time() - start)
    return out


def write_chat_variant(out, sizes=(("train", 2000), ("test", 200))):
    """`chat_data/`: the first prompts of `data/` as chat conversations (a `messages` column), for testing the
    chat-template path. Test conversations end in the reference reply, as No Robots' do (the scripts drop it)."""
    os.makedirs(os.path.join(out, "chat_data"), exist_ok=True)
    for split, size in sizes:
        with open(os.path.join(out, "data", f"{split}.jsonl")) as f:
            rows = [json.loads(line) for line in f][:size]
        with open(os.path.join(out, "chat_data", f"{split}.jsonl"), "w") as f:
            for row in rows:
                messages = [{"role": "user", "content": row["query"]}]
                if split == "test":
                    messages.append({"role": "assistant", "content": row["reference_response"].strip()})
                f.write(json.dumps({"messages": messages}) + "\n")


def _join(words_and_eos):
    words, has_eos = words_and_eos
    return " ".join(words), has_eos


def write_readme(out, args, stats, lines, seconds):
    text = f"""# The tiny task

Built by `python assets/make_tiny.py{' --quick' if args.quick else ''}` (seed {args.seed}) in
{seconds / 60:.1f} minutes on {os.cpu_count()} CPU cores. Do not edit by hand: rebuild instead.

- `sft/`: the SFT policy (GPT-NeoX, hidden 128, 2 layers, 2 heads of 64) and the tokenizer.
- `reward/`: the proxy reward model used for training (scores scaled to std 1 on SFT samples).
- `gold_reward/`: the gold reward model used for evaluation (regresses the gold function).
- `data/train.jsonl`, `data/test.jsonl`: `query` and `reference_response` columns.
- `chat_data/`: the first 2000 train and 200 test prompts as chat conversations (`messages`; a test
  conversation ends in its reference reply), for the chat-template path.

The gold function and how the data is drawn are in `assets/make_tiny.py`.

| measure (held-out test prompts) | value |
|---|---|
| gold RM pairwise accuracy vs gold function, mixed pairs | {stats['gold'][0]:.3f} ({stats['gold'][1]} pairs) |
| gold RM pairwise accuracy vs gold function, SFT-sample pairs | {stats['gold_sft'][0]:.3f} ({stats['gold_sft'][1]} pairs) |
| proxy RM pairwise accuracy vs gold function, mixed pairs | {stats['proxy'][0]:.3f} ({stats['proxy'][1]} pairs) |
| proxy RM pairwise accuracy vs gold function, SFT-sample pairs | {stats['proxy_sft'][0]:.3f} ({stats['proxy_sft'][1]} pairs) |

Mixed pairs: two responses to the same prompt drawn from SFT samples at temperatures 0.7, 1.0
and 1.4 and from synthetic responses (partial and complete answers, wrong words, repeats, no
EOS); pairs whose gold scores tie are left out.

## Build log

```
""" + "\n".join(lines) + "\n```\n"
    with open(os.path.join(out, "README.md"), "w") as f:
        f.write(text)


if __name__ == "__main__":
    main()
