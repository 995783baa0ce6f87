"""The scripts copy their common helpers on purpose; the copies must stay identical.

A function or class defined at the top level of two scripts under the same name must have the
same source in both (decorators included), so a fix made in one script is made in all.
`validate` is the one helper that is meant to differ (each script checks its own arguments);
`Args` differs by each algorithm's fields, but a field that two algorithm scripts share has the
same meaning (docstring). evaluate.py shares the generation and scoring helpers."""

import ast
import itertools
import os

import pytest
from conftest import ROOT

ALGORITHMS = ["rloo.py", "online_dpo.py", "bok.py", "ppo.py", "online_dpo_vllm.py"]
SCRIPTS = ALGORITHMS + ["evaluate.py"]
MEANT_TO_DIFFER = {"validate", "Args"}
CORE = {"load_prompts", "left_pad", "generate", "truncate_response", "response_logprobs", "reward_scores",
        "apply_missing_eos_penalty", "evaluate", "save_checkpoint", "load_checkpoint", "ds_config"}


def top_level_definitions(script):
    with open(os.path.join(ROOT, script)) as f:
        source = f.read()
    lines = source.splitlines()
    return {node.name: (node, "\n".join(lines[min([d.lineno for d in node.decorator_list] + [node.lineno]) - 1:
                                               node.end_lineno]))
            for node in ast.parse(source).body if isinstance(node, (ast.FunctionDef, ast.ClassDef))}


def field_docstrings(args_class):
    body = args_class.body
    return {node.target.id: following.value.value for node, following in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)}


@pytest.mark.parametrize("first, second", list(itertools.combinations(SCRIPTS, 2)))
def test_helpers_shared_by_two_scripts_have_identical_source(first, second):
    a, b = top_level_definitions(first), top_level_definitions(second)
    shared = (a.keys() & b.keys()) - MEANT_TO_DIFFER
    if "evaluate.py" not in (first, second):
        assert CORE <= shared, f"helpers missing from one of the scripts: {CORE - shared}"
    else:
        assert {"generate", "truncate_response", "reward_scores", "start_vllm", "vllm_generate"} & a.keys() <= shared
    differ = sorted(name for name in shared if a[name][1] != b[name][1])
    assert not differ, f"{first} and {second} define these differently: {differ}"


@pytest.mark.parametrize("first, second", list(itertools.combinations(ALGORITHMS, 2)))
def test_arguments_with_the_same_name_have_the_same_meaning(first, second):
    a = field_docstrings(top_level_definitions(first)["Args"][0])
    b = field_docstrings(top_level_definitions(second)["Args"][0])
    assert len(a.keys() & b.keys()) > 30
    differ = sorted(name for name in a.keys() & b.keys() if a[name] != b[name])
    assert not differ, f"{first} and {second} document these arguments differently: {differ}"
