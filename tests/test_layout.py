"""The layout: every detail of the algorithm lives in its script; the machinery that is not the algorithm is defined
once, in flat modules that every script imports (as CleanRL's scripts import cleanrl_utils).

A script holds its Args, its algorithm's functions, main (the set-up and the loop), its own validate, and the RLHF
details the loop computes with, which every script repeats on purpose and which must stay identical. No script
defines what a module defines, and no two modules define the same name."""

import ast
import glob
import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import ROOT, read_metrics, run_dir_of, run_script

ALGORITHMS = ["rloo.py", "online_dpo.py", "bok.py", "ppo.py", "grpo.py", "online_dpo_vllm.py", "rloo_vllm.py",
              "ppo_vllm.py", "bok_vllm.py", "grpo_vllm.py", "tba.py", "tba_vllm.py"]
SCRIPTS = ALGORITHMS + ["evaluate.py"]
MODULES = ["checks.py", "data.py", "distributed.py", "checkpoints.py", "runlog.py", "evaluation.py", "vllm_engine.py",
           "weight_handoff.py", "generator.py"]
# The RLHF details the loop computes with: the same source in every script that has them.
DETAILS = {"generate", "truncate_response", "forward", "response_logprobs", "entropy_from_logits", "reward_scores",
           "last_number_reward", "RULE_REWARDS", "score_responses", "apply_missing_eos_penalty", "masked_mean",
           "vllm_generate"}
MEANT_TO_DIFFER = {"validate", "Args", "main"}
# The asynchronous RLOO, PPO and GRPO weight their policy loss by the off-policy correction's importance weights
# (test_off_policy_correction.py checks that with weights of 1 they are their synchronous siblings' losses).
CORRECTED = {"rloo_policy_loss", "ppo_policy_loss", "grpo_policy_loss"}
# Arguments whose name papers gave several meanings: DPO's beta and loss types, GRPO's KL weight and objectives, TBA's
# target temperature.
OWN_MEANING = {"beta", "loss_type"}
# GRPO's five loss types with their papers' defaults, DAPO's overlong shaping and (grpo.py) dynamic sampling.
MOST_LINES = {"ppo.py": 550, "ppo_vllm.py": 700, "grpo.py": 590, "grpo_vllm.py": 670, "evaluate.py": 400}
# (else 500, and 650 for a *_vllm.py)
ALGORITHM_BANNER = "# The algorithm: the only functions that differ"


def definitions(path):
    """{name: (node, source)} of the top-level functions, classes and assignments of a file."""
    with open(os.path.join(ROOT, path)) as f:
        source = f.read()
    lines = source.splitlines()
    found = {}
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            name = node.name
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name = node.targets[0].id
        else:
            continue
        start = min([d.lineno for d in getattr(node, "decorator_list", [])] + [node.lineno]) - 1
        found[name] = (node, "\n".join(lines[start: node.end_lineno]))
    return found


def field_docstrings(args_class):
    body = args_class.body
    return {node.target.id: following.value.value for node, following in zip(body, body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(following, ast.Expr)}


def test_the_machinery_is_defined_once():
    """No name in two modules; no script defines a name a module defines (a fix is made once)."""
    owner = {}
    for module in MODULES:
        for name in definitions(module):
            assert name not in owner, f"{name} is defined in {owner[name]} and {module}"
            owner[name] = module
    for script in SCRIPTS:
        copied = sorted(set(definitions(script)) & set(owner))
        assert not copied, f"{script} defines what the modules define: {[(n, owner[n]) for n in copied]}"


def test_every_script_holds_the_rlhf_details_and_they_are_the_same():
    sources = {script: definitions(script) for script in SCRIPTS}
    for script in ALGORITHMS:
        expected = DETAILS - (set() if script.endswith("_vllm.py") else {"vllm_generate"})
        assert expected <= sources[script].keys(), f"{script} lacks {expected - sources[script].keys()}"
    for name in DETAILS:
        versions = {script: s[name][1] for script, s in sources.items() if name in s}
        assert len(set(versions.values())) == 1, f"{name} differs between {sorted(versions)}"


@pytest.mark.parametrize("first, second", list(itertools.combinations(SCRIPTS, 2)))
def test_functions_shared_by_two_scripts_have_identical_source(first, second):
    a, b = definitions(first), definitions(second)
    corrected = CORRECTED if first.endswith("_vllm.py") != second.endswith("_vllm.py") else set()
    differ = sorted(name for name in (a.keys() & b.keys()) - MEANT_TO_DIFFER - corrected if a[name][1] != b[name][1])
    assert not differ, f"{first} and {second} define these differently: {differ}"


@pytest.mark.parametrize("first, second", list(itertools.combinations(ALGORITHMS, 2)))
def test_arguments_with_the_same_name_have_the_same_meaning(first, second):
    a = field_docstrings(definitions(first)["Args"][0])
    b = field_docstrings(definitions(second)["Args"][0])
    assert len(a.keys() & b.keys()) > 30
    algorithms = {script.removesuffix(".py").removesuffix("_vllm") for script in (first, second)}
    own = OWN_MEANING if len(algorithms) == 2 and algorithms <= {"online_dpo", "grpo", "tba"} else set()
    own |= {"is_level"} if "rloo_vllm.py" in (first, second) else set()  # RLOO's ratio is one per response
    differ = sorted(name for name in (a.keys() & b.keys()) - own if a[name] != b[name])
    assert not differ, f"{first} and {second} document these arguments differently: {differ}"


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_reads_args_algorithm_main_then_its_checks_and_details(script):
    """Args, the algorithm's own functions (evaluate.py: its evaluation's), main (set-up, then the loop within the first
    350 lines), validate, the RLHF details; the file ends by calling main; and it is short enough to hold in one's head."""
    with open(os.path.join(ROOT, script)) as f:
        lines = f.read().splitlines()
    limit = MOST_LINES.get(script, 650 if script.endswith("_vllm.py") else 500)
    assert len(lines) <= limit, f"{script} has {len(lines)} lines (at most {limit})"
    banner = "# Evaluation's own functions" if script == "evaluate.py" else ALGORITHM_BANNER
    algorithm = next(i for i, line in enumerate(lines) if line.startswith(banner))
    line_of = {name: node.lineno - 1 for name, (node, _) in definitions(script).items()}
    assert line_of["Args"] < algorithm < line_of["main"] < line_of["validate"]
    assert all(line_of["validate"] < line for name, line in line_of.items() if name in DETAILS)
    assert lines[-2:] == ['if __name__ == "__main__":', "    main(parse_arguments(Args))"]
    if script != "evaluate.py":
        loop = next(i for i, line in enumerate(lines) if line.startswith("    for update in range("))
        assert line_of["main"] < loop < 350, f"the loop starts at line {loop + 1}"
        assert "deepspeed.initialize(" in "\n".join(lines[line_of["main"]: loop]), "the DeepSpeed set-up is inline"


@pytest.mark.parametrize("module", MODULES)
def test_each_module_says_what_it_holds(module):
    with open(os.path.join(ROOT, module)) as f:
        docstring = ast.get_docstring(ast.parse(f.read()))
    assert docstring and "Nothing here changes what is learned" in docstring


def test_no_unused_import_or_variable():
    result = subprocess.run([sys.executable, "-m", "pyflakes", *SCRIPTS, *MODULES, "tests", "benchmark", "assets"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout, result.stdout


def test_every_top_level_python_file_is_a_script_or_a_module():
    assert sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py"))) == sorted(SCRIPTS + MODULES)


@pytest.mark.slow
def test_a_copied_script_with_an_edited_loss_runs_and_its_run_keeps_its_code(tmp_path):
    """`cp rloo.py my_rloo.py`, an edit of the loss (doubled), `python my_rloo.py`: it runs on the modules, its loss is
    twice rloo.py's on the same seed, its checkpoint names it, and wandb's code snapshot holds it and the modules."""
    copy = os.path.join(ROOT, f"my_rloo_{os.getpid()}.py")
    with open(os.path.join(ROOT, "rloo.py")) as f:
        source = f.read()
    loss = "return torch.max(pg_losses, pg_losses_clipped).mean(), log_ratio"
    assert source.count(loss) == 1
    with open(copy, "w") as f:
        f.write(source.replace(loss, loss.replace("return torch.max", "return 2 * torch.max")))
    arguments = ["--total-episodes", "32", "--per-device-train-batch-size", "16", "--eval-every", "0",
                 "--num-eval-prompts", "8"]
    try:
        run_script(os.path.basename(copy), *arguments, "--track", "--output-dir", str(tmp_path / "copy"),
                   env={"WANDB_DIR": str(tmp_path)})
    finally:
        os.remove(copy)
    run_script("rloo.py", *arguments, "--output-dir", str(tmp_path / "original"))
    copied, original = (read_metrics(run_dir_of(str(tmp_path / d))) for d in ("copy", "original"))
    assert copied[1]["loss/policy_avg"] == pytest.approx(2 * original[1]["loss/policy_avg"], rel=1e-5)
    assert copied[1]["loss/policy_avg"] != 0
    with open(os.path.join(run_dir_of(str(tmp_path / "copy")), "checkpoint-2", "trainer_state.json")) as f:
        assert json.load(f)["script"] == os.path.basename(copy)
    snapshot = {os.path.basename(p) for p in glob.glob(str(tmp_path / "wandb" / "**" / "*.py"), recursive=True)}
    assert {os.path.basename(copy), "checks.py", "data.py", "distributed.py", "checkpoints.py", "runlog.py",
            "evaluation.py"} <= snapshot, snapshot
    assert "rloo.py" not in snapshot and not re.search(r"vllm|generator", " ".join(snapshot))
    shutil.rmtree(tmp_path / "wandb", ignore_errors=True)
