"""The trained tokens of the algorithms that train on part of what they sample: online DPO on each prompt's chosen and
rejected responses, best-of-k on its best (none where its k scores tie), TBA on the groups it draws from its buffer.
Each logs val/trained_tokens, the response tokens its loss took, and the run log's time/trained_tokens_per_second
divides that, not the batch's generated tokens, by the training seconds. Here a short run of each HF script, its
batches recorded as it ran, against a count by hand; the *_vllm.py siblings count with the same expression."""

import ast
import json

import pytest

from conftest import SHIPPED, definitions, read_metrics, run_dir_of, run_patched

# Two updates of 16 prompts x k = 4: a pair is 2 of 4 responses, a best 1 of 4. Online DPO and best-of-k on the math
# task, whose 0/1 rule reward ties often (a pair of one response twice, a prompt without a best); TBA on the tiny task,
# whose responses' lengths vary (the math task's are all about 4 tokens: any draw from the buffer counts alike), with
# a batch of other prompts in its buffer before the first update.
SHORT = ["--k", "4", "--total-episodes", "128", "--eval-every", "0", "--num-eval-prompts", "8"]
MATH = ["--sft-model-path", "assets/tiny_math/sft", "--dataset-name", "assets/tiny_math/data", "--rule-reward",
        "last_number", "--response-length", "8", "--max-prompt-length", "48"]
CASES = {"online_dpo": MATH + SHORT, "bok": MATH + SHORT, "tba": SHORT + ["--buffer-prefill", "64"]}

# Each script runs in a child forked after the libraries are imported once; its batches are recorded through the
# functions main() calls: the penalised scores of the batch's responses (online DPO and best-of-k choose by them), the
# pad id, and the groups TBA's buffer gives its training.
SPY = """
import json, os, sys, traceback
import bok, online_dpo, tba

def spied(script, output_dir):
    records = {"pad": None, "batches": [], "groups": []}
    truncate, penalty, sample = script.truncate_response, script.apply_missing_eos_penalty, tba.ReplayBuffer.sample

    def spy_truncate(responses, stop_token_id, pad_token_id):
        records["pad"] = pad_token_id
        return truncate(responses, stop_token_id, pad_token_id)

    def spy_penalty(scores, responses, *rest):
        penalised = penalty(scores, responses, *rest)
        records["batches"].append([responses.tolist(), penalised.tolist()])
        return penalised

    def spy_sample(self, *arguments):
        groups = sample(self, *arguments)
        records["groups"].append([[list(entry[0]) for entry in group] for _, group, _ in groups])
        return groups

    script.truncate_response, script.apply_missing_eos_penalty = spy_truncate, spy_penalty
    tba.ReplayBuffer.sample = spy_sample
    sys.argv = [script.__name__ + ".py", *CASES[script.__name__], "--output-dir", output_dir]
    script.main(script.parse_arguments(script.Args))
    return records

for script in (online_dpo, bok, tba):
    read, write = os.pipe()
    if os.fork() == 0:
        os.close(read)
        try:
            records = spied(script, os.path.join(OUTPUT, script.__name__))
            with os.fdopen(write, "w") as f:
                f.write(json.dumps(records))
        except BaseException:
            traceback.print_exc()
            os._exit(1)
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    status = os.wait()[1]
    print(f"RECORDS {script.__name__} " + (text if status == 0 and text else "null"), flush=True)
"""


def tokens(response, pad):
    return sum(token != pad for token in response)


def columns(scores, k):
    """Each prompt's k scores (sample j of prompt i is row j x prompts + i) and its rows."""
    prompts = len(scores) // k
    return [([scores[j * prompts + i] for j in range(k)], [j * prompts + i for j in range(k)]) for i in range(prompts)]


def pair_tokens(responses, scores, k, pad):
    """Online DPO's by hand: each prompt's first highest and first lowest scoring response, the same one twice where
    its k scores are equal."""
    return sum(tokens(responses[rows[own.index(max(own))]], pad) + tokens(responses[rows[own.index(min(own))]], pad)
               for own, rows in columns(scores, k))


def best_tokens(responses, scores, k, pad):
    """Best-of-k's by hand: each prompt's first highest scoring response, none where its k scores are equal."""
    return sum(tokens(responses[rows[own.index(max(own))]], pad) for own, rows in columns(scores, k)
               if max(own) > min(own))


@pytest.mark.slow
def test_the_logged_trained_tokens_are_those_the_loss_took(tmp_path):
    """Two updates of online_dpo.py, bok.py and tba.py (k = 4; about 40 s): each update's val/trained_tokens equals
    the count by hand from the batch recorded as the run made it, and differs from the batch's generated tokens;
    time/trained_tokens_per_second is it over time/training."""
    result, errors = run_patched(f"OUTPUT, CASES = {str(tmp_path)!r}, {CASES!r}\n" + SPY)
    assert result.returncode == 0 and not errors, result.stderr[-3000:]
    records = {line.split()[1]: json.loads(line.split(" ", 2)[2]) for line in result.stdout.splitlines()
               if line.startswith("RECORDS ")}
    assert all(records.values()), (records, result.stderr[-3000:])
    counted = {}
    for script, count in (("online_dpo", pair_tokens), ("bok", best_tokens)):
        pad = records[script]["pad"]
        counted[script] = [count(responses, scores, 4, pad) for responses, scores in records[script]["batches"]]
    counted["tba"] = [sum(len(response) for group in groups for response in group)
                      for groups in records["tba"]["groups"]]  # the buffer keeps a response without its padding
    generated = {}
    for script, by_hand in counted.items():
        rows = [row for row in read_metrics(run_dir_of(tmp_path / script)) if row["update"] > 0]
        assert len(by_hand) == len(rows) == 2, (script, by_hand)
        assert [row["val/trained_tokens"] for row in rows] == by_hand, script
        for row in rows:
            rate = row["val/trained_tokens"] / row["time/training"]  # one process
            assert row["time/trained_tokens_per_second"] == pytest.approx(rate)
        generated[script] = [64 * row["val/response_length"] for row in rows]
    # a pair is 2 of 4 responses, a best 1 of 4 (fewer where scores tie): never the batch's generated tokens
    assert all(t < g for script in ("online_dpo", "bok") for t, g in zip(counted[script], generated[script]))
    assert counted["tba"] != generated["tba"]  # half the groups, on average, drawn from the whole buffer
    # the math task's 0/1 reward tied some prompt's 4 scores: a pair of one response, a prompt without a best
    ties = [max(own) == min(own) for responses, scores in records["bok"]["batches"] for own, _ in columns(scores, 4)]
    assert any(ties) and not all(ties), ties


def trained_tokens_source(script):
    """The source of the value main() logs as val/trained_tokens."""
    main = definitions(script)["main"][0]
    (value,) = [value for node in ast.walk(main) if isinstance(node, ast.Dict)
                for key, value in zip(node.keys, node.values)
                if isinstance(key, ast.Constant) and key.value == "val/trained_tokens"]
    return ast.unparse(value)


@pytest.mark.parametrize("script", ["online_dpo", "bok", "tba"])
def test_the_vllm_sibling_counts_the_trained_tokens_alike(script):
    """The *_vllm.py sibling's run takes minutes to start vLLM: its count is read here, the same expression on the same
    names as the HF script's tested above."""
    assert f"{script}_vllm.py" in SHIPPED
    assert trained_tokens_source(f"{script}.py") == trained_tokens_source(f"{script}_vllm.py")
