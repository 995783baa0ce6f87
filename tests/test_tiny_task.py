"""The tiny task: its gold function, its determinism, the shipped assets and the quick rebuild."""

import json
import os
import random

import pytest
from conftest import TINY, run_script
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

import make_tiny

QUERY = "SUBREDDIT: r/food\nPOST: apple bread dog rice the apple\nTL;DR:"


def test_gold_score_by_hand():
    assert make_tiny.gold_score(QUERY, " apple rice bread", True) == 0.2 * 3
    # apple +0.2, rice +0.2, the -0.2, cat -0.2, apple +0.2 (words of the topic count, whether
    # or not they repeat or appear in the post); then -0.5 without EOS.
    assert abs(make_tiny.gold_score(QUERY, " apple rice the cat apple", True) - 0.2) < 1e-9
    assert abs(make_tiny.gold_score(QUERY, " apple rice the cat apple", False) - (-0.3)) < 1e-9
    assert make_tiny.gold_score(QUERY, "", True) == 0.0
    # Five topic words are the best answer; each word after the fifth costs 0.3 more.
    assert abs(make_tiny.gold_score(QUERY, " apple rice bread soup cake", True) - 1.0) < 1e-9
    assert abs(make_tiny.gold_score(QUERY, " apple rice bread soup cake salad", True) - 0.9) < 1e-9


def test_posts_and_references_are_deterministic_and_leave_headroom():
    def draw(seed):
        rng = random.Random(seed)
        posts = [make_tiny.make_post(rng) for _ in range(300)]
        return posts, [make_tiny.make_reference(rng, p, m) for p, m in posts]

    posts, refs = draw(0)
    assert (posts, refs) == draw(0)
    ref_gold = [make_tiny.gold_score(make_tiny.query_text(p, m), " ".join(r), True) for (p, m), r in zip(posts, refs)]
    assert 0.2 < sum(ref_gold) / len(ref_gold) < 0.5  # the best answer scores 1.0
    assert max(len(r) for r in refs) >= 5  # long answers stay possible for the SFT policy


def test_shipped_assets_load_and_share_one_tokenizer():
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "sft"))
    for word in make_tiny.ALL_WORDS:
        assert len(tokenizer.encode(" " + word, add_special_tokens=False)) == 1, word
    policy = AutoModelForCausalLM.from_pretrained(os.path.join(TINY, "sft"))
    assert policy.config.model_type == "gpt_neox"
    assert policy.config.hidden_size // policy.config.num_attention_heads == 64  # vLLM's CPU attention needs it
    for name in ("reward", "gold_reward"):
        rm = AutoModelForSequenceClassification.from_pretrained(os.path.join(TINY, name))
        assert rm.config.num_labels == 1
        assert AutoTokenizer.from_pretrained(os.path.join(TINY, name)).get_vocab() == tokenizer.get_vocab()
    with open(os.path.join(TINY, "build_stats.json")) as f:
        stats = json.load(f)
    assert stats["gold_rm_accuracy"] >= 0.9 and stats["proxy_rm_accuracy"] >= 0.9


def test_gold_reward_model_ranks_responses_like_the_gold_function():
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(TINY, "gold_reward"))
    rm = AutoModelForSequenceClassification.from_pretrained(os.path.join(TINY, "gold_reward"))
    with open(os.path.join(TINY, "data", "test.jsonl")) as f:
        query = json.loads(f.readline())["query"]
    topic_words = make_tiny.TOPICS[make_tiny.topic_of_query(query)]
    other = next(w for w in make_tiny.FILLER if w not in query)
    responses = [(" " + " ".join(topic_words[:5]), True), (" " + " ".join(topic_words[:3]), True),
                 (" " + topic_words[0], True), (" " + other, True), (" " + topic_words[0], False)]
    gold = [make_tiny.gold_score(query, r, e) for r, e in responses]
    assert gold == sorted(gold, reverse=True)
    scores = make_tiny.rm_scores(rm, tokenizer, [(query, r, e) for r, e in responses])
    assert scores.tolist() == sorted(scores.tolist(), reverse=True), scores


@pytest.mark.slow
def test_quick_rebuild(tmp_path):
    out = tmp_path / "tiny"
    run_script("assets/make_tiny.py", "--quick", "--out", str(out), timeout=900)  # (slower beside another test)
    for name in ("sft", "reward", "gold_reward"):
        assert os.path.isfile(out / name / "config.json") and os.path.isfile(out / name / "tokenizer.json")
    assert sum(1 for _ in open(out / "data" / "train.jsonl")) == 4000
    stats = json.loads((out / "build_stats.json").read_text())
    assert sum(1 for _ in open(out / "chat_data" / "train.jsonl")) == 2000
    assert stats["gold_rm_accuracy"] > 0.55 and stats["proxy_rm_accuracy"] > 0.55  # better than chance; far from 0.9
    assert "pairwise accuracy" in (out / "README.md").read_text()
