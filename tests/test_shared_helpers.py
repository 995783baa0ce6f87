"""The scripts copy their common helpers on purpose; the copies must stay identical.

A function or class defined at the top level of two scripts under the same name must have the
same source in both (decorators included), so a fix made in one script is made in all.
`validate` and `main` are meant to differ (each script checks its own arguments and runs its own loop);
`Args` differs by each algorithm's fields, but a field that two algorithm scripts share has the
same meaning (docstring). evaluate.py shares the generation and scoring helpers."""

import ast
import itertools
import os
import subprocess
import sys

import pytest
from conftest import ROOT

ALGORITHMS = ["rloo.py", "online_dpo.py", "bok.py", "ppo.py", "grpo.py", "online_dpo_vllm.py", "rloo_vllm.py",
              "ppo_vllm.py", "bok_vllm.py", "grpo_vllm.py"]
SCRIPTS = ALGORITHMS + ["evaluate.py"]
MEANT_TO_DIFFER = {"validate", "Args", "main"}
# The asynchronous RLOO, PPO and GRPO weight their policy loss by the off-policy correction's importance weights
# (test_off_policy_correction.py checks that with weights of 1 they are their synchronous siblings' losses).
CORRECTED = {"rloo_policy_loss", "ppo_policy_loss", "grpo_policy_loss"}
# Arguments whose name two papers gave two meanings: DPO's beta and loss types, GRPO's KL weight and objectives.
OWN_MEANING = {"beta", "loss_type"}
CORE = {"load_prompts", "left_pad", "generate", "truncate_response", "response_logprobs", "reward_scores",
        "apply_missing_eos_penalty", "evaluate", "save_checkpoint", "load_checkpoint", "ds_config", "mean_over_ranks",
        "process_group_backend", "init_distributed", "gathered_state_dict", "set_up_distributed", "load_data",
        "run_directory", "load_model", "training_engine", "frozen_engine", "RunLog"}
BANNERS = ["# The algorithm: the only functions that differ", "# Appendix: argument checks"]
VLLM_BANNER = "# Asynchronous generation, identical in every *_vllm.py"


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
    corrected = CORRECTED if first.endswith("_vllm.py") != second.endswith("_vllm.py") else set()
    shared = (a.keys() & b.keys()) - MEANT_TO_DIFFER - corrected
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
    algorithms = {script.removesuffix(".py").removesuffix("_vllm") for script in (first, second)}
    own = OWN_MEANING if algorithms == {"online_dpo", "grpo"} else set()
    differ = sorted(name for name in (a.keys() & b.keys()) - own if a[name] != b[name])
    assert not differ, f"{first} and {second} document these arguments differently: {differ}"


@pytest.mark.parametrize("script", ALGORITHMS + ["evaluate.py"])
def test_each_script_reads_args_algorithm_main_then_the_appendix(script):
    """Args, the algorithm's own functions (evaluate.py: its evaluation's), `def main(args)` (set-up, then the loop,
    which starts within the first 350 lines), then the appendix: validate, the plumbing that every script shares,
    (in *_vllm.py) the asynchronous generation; the file ends by calling main."""
    with open(os.path.join(ROOT, script)) as f:
        lines = f.read().splitlines()
    own = "# Evaluation's own functions" if script == "evaluate.py" else BANNERS[0]
    algorithm, appendix = (next(i for i, line in enumerate(lines) if line.startswith(b)) for b in (own, BANNERS[1]))
    vllm = next((i for i, line in enumerate(lines) if line.startswith(VLLM_BANNER)), None)
    assert (vllm is not None) == script.endswith("_vllm.py")
    definitions = top_level_definitions(script)
    line_of = {name: node.lineno - 1 for name, (node, _) in definitions.items()}
    assert line_of["Args"] < algorithm < line_of["main"] < appendix < line_of["validate"] < (vllm or len(lines))
    assert lines[-2:] == ['if __name__ == "__main__":', "    main(tyro.cli(Args))"]
    assert algorithm < 300, f"the algorithm starts at line {algorithm + 1}"
    if script != "evaluate.py":
        loop = next(i for i, line in enumerate(lines) if line.startswith("    for update in range("))
        assert line_of["main"] < loop < 350, f"the loop starts at line {loop + 1}"
    others = [top_level_definitions(s) for s in ALGORITHMS if s != script]
    for name, line in line_of.items():
        shared = [other[name][1] == definitions[name][1] for other in others if name in other]
        everywhere = len(shared) == len(others) and all(shared)
        if algorithm < line < line_of["main"] and script != "evaluate.py":  # (online DPO's are in two scripts)
            assert not everywhere, f"{name} is the same in every script: it is plumbing"
        elif line_of["validate"] < line < (vllm or len(lines)) and script != "evaluate.py":
            assert everywhere, f"{name} is not the same in every script: it is not plumbing"


def test_no_unused_import_or_variable():
    result = subprocess.run([sys.executable, "-m", "pyflakes", *SCRIPTS, "tests", "benchmark", "assets"], cwd=ROOT,
                            capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout, result.stdout
