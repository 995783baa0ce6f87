"""The layout: every detail of the algorithm lives in its script; the machinery that is not the algorithm is defined
once, in flat modules that every script imports (as CleanRL's scripts import cleanrl_utils).

A script holds its Args, its algorithm's functions, main (the set-up and the loop), its own validate, and the RLHF
details the loop computes with, which every shipped script repeats on purpose and which must stay identical among them.
Scripts are found by their shape (conftest.is_script), so a researcher's new script is held to the reading order and
the size guard without being added to any list; only the shipped ones (conftest.SHIPPED) must keep the details
identical: a copy is free to differ, its difference is the point."""

import ast
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import (ALGORITHM_BANNER, ALGORITHMS, MODULES, ROOT, SCRIPTS, SHIPPED, TOP_LEVEL, definitions, is_script,
                      read_metrics, run, run_dir_of, run_script)

# The RLHF details the loop computes with: the same source in every shipped script that has them.
DETAILS = {"generate", "truncate_response", "forward", "response_logits", "response_logprobs", "entropy_from_logits",
           "reward_scores", "last_number_reward", "RULE_REWARDS", "score_responses", "apply_missing_eos_penalty",
           "masked_mean", "sampling_params", "batch_prompts"}
# Arguments whose name papers gave several meanings: DPO's beta and loss types, GRPO's KL weight and objectives, TBA's
# target temperature.
OWN_MEANING = {"beta", "loss_type"}
# A guard against re-growing copies, well above the aim (README: about 500 lines, 650 for a *_vllm.py).
MOST_LINES = {False: 650, True: 800}
# What main may call of the asynchrony (generator.py, weight_handoff.py, vllm_engine.py): the object and its methods.
MOST_ASYNC_CALLS = 5


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


@pytest.mark.parametrize("script", ALGORITHMS)
def test_every_algorithm_script_holds_the_rlhf_details(script):
    expected = DETAILS - (set() if script.endswith("_vllm.py") else {"sampling_params", "batch_prompts"})
    missing = expected - definitions(script).keys()
    assert not missing, f"{script} lacks {sorted(missing)}"


@pytest.mark.parametrize("name", sorted(DETAILS))
def test_the_shipped_scripts_hold_the_same_rlhf_details(name):
    """A detail changed in one shipped script is changed in all of them; the failure names them and the command that
    copies one version to the others."""
    versions = {}
    for script in SHIPPED:
        found = definitions(script)
        if name in found:
            versions.setdefault(found[name][1], []).append(script)
    if len(versions) > 1:
        groups = sorted(versions.values(), key=len)
        pytest.fail(f"{name} differs among the shipped scripts: {', '.join(groups[0])} against "
                    f"{'; '.join(', '.join(g) for g in groups[1:])}. Change them together: "
                    f"`python tests/sync_detail.py {name} {groups[0][0]}` copies {groups[0][0]}'s {name} to every "
                    f"shipped script that defines it.")


@pytest.mark.parametrize("first, second", [(a, b) for i, a in enumerate(SHIPPED) for b in SHIPPED[i + 1:]
                                           if a in ALGORITHMS and b in ALGORITHMS])
def test_arguments_with_the_same_name_have_the_same_meaning(first, second):
    a = field_docstrings(definitions(first)["Args"][0])
    b = field_docstrings(definitions(second)["Args"][0])
    assert len(a.keys() & b.keys()) > 30
    algorithms = {script.removesuffix(".py").removesuffix("_vllm") for script in (first, second)}
    own = OWN_MEANING if len(algorithms) == 2 and algorithms <= {"online_dpo", "grpo", "tba"} else set()
    own |= {"is_level"} if "rloo_vllm.py" in (first, second) else set()  # RLOO's ratio is one per response
    differ = sorted(name for name in (a.keys() & b.keys()) - own if a[name] != b[name])
    assert not differ, f"{first} and {second} document these arguments differently: {differ}"


def _main_and_loop(script):
    with open(os.path.join(ROOT, script)) as f:
        lines = f.read().splitlines()
    main = definitions(script)["main"][0]
    loop = next((i for i in range(main.lineno, main.end_lineno) if lines[i].startswith("    for update in range(")), None)
    return lines, main, loop


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_reads_args_algorithm_main_then_its_checks_and_details(script):
    """A module docstring; Args; the algorithm's own functions under their banner (evaluate.py: its evaluation's); main,
    with DeepSpeed's set-up in view and then the loop as numbered steps; validate; the RLHF details; the file ends by
    calling main. And it is not a re-grown copy: at most 650 lines, 800 for a *_vllm.py."""
    lines, main, loop = _main_and_loop(script)
    limit = MOST_LINES[script.endswith("_vllm.py")]
    assert len(lines) <= limit, f"{script} has {len(lines)} lines: past {limit}, it has re-grown copies of something"
    with open(os.path.join(ROOT, script)) as f:
        assert ast.get_docstring(ast.parse(f.read())), f"{script} has no module docstring"
    banner = ALGORITHM_BANNER if script in ALGORITHMS else "# Evaluation's own functions"
    algorithm = next(i for i, line in enumerate(lines) if line.startswith(banner))
    line_of = {name: node.lineno - 1 for name, (node, _) in definitions(script).items()}
    assert line_of["Args"] < algorithm < line_of["main"] < line_of["validate"], "Args, the algorithm, main, validate"
    late = sorted(name for name, line in line_of.items() if name in DETAILS and line < line_of["validate"])
    assert not late, f"these RLHF details come before validate: {late}"
    assert lines[-2:] == ['if __name__ == "__main__":', "    main(parse_arguments(Args))"]
    if script in ALGORITHMS:
        assert loop is not None, "main's loop: `for update in range(...)`"
        assert "deepspeed.initialize(" in "\n".join(lines[main.lineno: loop]), "DeepSpeed's set-up is in main"
        steps = [int(m.group(1)) for line in lines[loop: main.end_lineno] if (m := re.match(r" {8}# (\d+)\. ", line))]
        assert steps and steps == list(range(1, len(steps) + 1)), f"the loop's numbered steps: {steps}"


@pytest.mark.parametrize("script", [s for s in SCRIPTS if s.endswith("_vllm.py")])
def test_the_asynchrony_is_one_object_with_a_handful_of_calls(script):
    """main makes the asynchrony once and calls a handful of its methods (a batch in step 1, the weights in step 5, a
    checkpoint's files, close); nothing of generator.py, weight_handoff.py or vllm_engine.py is threaded through it."""
    lines, main, _ = _main_and_loop(script)
    tree = ast.parse(open(os.path.join(ROOT, script)).read())
    asynchrony = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
                  and node.module in ("generator", "weight_handoff", "vllm_engine") for alias in node.names}
    made = [node.targets[0].id for node in ast.walk(main) if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Call) and getattr(node.value.func, "id", None) in asynchrony]
    assert len(made) == 1, f"main makes the asynchrony once: {made}"
    calls = {node.func.id for node in ast.walk(main) if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
             and node.func.id in asynchrony}
    calls |= {f"{made[0]}.{node.func.attr}" for node in ast.walk(main) if isinstance(node, ast.Call)
              and isinstance(node.func, ast.Attribute) and getattr(node.func.value, "id", None) == made[0]}
    assert len(calls) <= MOST_ASYNC_CALLS, sorted(calls)


@pytest.mark.parametrize("module", MODULES)
def test_each_module_says_what_it_holds(module):
    """And whether anything in it changes what is learned, naming it (a decision a researcher may want to change)."""
    with open(os.path.join(ROOT, module)) as f:
        docstring = " ".join((ast.get_docstring(ast.parse(f.read())) or "").split())
    assert "Nothing here changes what is learned" in docstring or "What here changes what is learned: " in docstring


@pytest.mark.parametrize("module", MODULES)
def test_a_module_uses_only_what_it_imports(module):
    """The import graph shows every dependency between modules: each name of another module's top level that a module
    uses, it imports."""
    tree = ast.parse(open(os.path.join(ROOT, module)).read())
    imported = {alias.asname or alias.name for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    own = set(definitions(module))
    others = {name: other for other in MODULES if other != module for name in definitions(other)
              if not name.startswith("_")}
    local = {node.arg for node in ast.walk(tree) if isinstance(node, ast.arg)} | \
        {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    used = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name)} - local
    foreign = sorted(f"{name} ({others[name]})" for name in used & others.keys() - own - imported)
    assert not foreign, f"{module} uses what it does not import: {foreign}"


@pytest.mark.parametrize("module", MODULES)
def test_a_module_writes_to_args_only_in_the_checks_that_validate_calls(module):
    """After validate, `args` is what the user asked for and validate derived: no module writes to it at run time."""
    writers = set()
    for function in ast.walk(ast.parse(open(os.path.join(ROOT, module)).read())):
        if isinstance(function, ast.FunctionDef):
            for node in ast.walk(function):
                targets = node.targets if isinstance(node, ast.Assign) else [getattr(node, "target", None)]
                if any(isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "args" for t in targets) or \
                        (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setattr"
                         and getattr(node.args[0], "id", None) == "args"):
                    writers.add(function.name)
    assert all(name.startswith("check_") for name in writers), f"{module} writes to args in {sorted(writers)}"


def test_no_unused_import_or_variable():
    result = subprocess.run([sys.executable, "-m", "pyflakes", *SCRIPTS, *MODULES, "tests", "benchmark", "assets"],
                            cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0 and not result.stdout, result.stdout


def lost_shapes(paths):
    """The files that run as a program (an `if __name__ == "__main__":` block) without a script's shape."""
    lost = []
    for path in paths:
        with open(os.path.join(ROOT, path)) as f:
            if re.search(r"^if __name__ == .__main__.:", f.read(), re.M) and not is_script(path):
                lost.append(path)
    return lost


def test_every_top_level_python_file_is_a_script_or_a_module(tmp_path):
    """A file that runs as a program but lost a script's shape (an Args dataclass and main(args)) is named here rather
    than skipped by every test that finds scripts by their shape; a researcher's helper module is welcome."""
    helper, broken = tmp_path / "my_reward.py", tmp_path / "my_rloo.py"
    helper.write_text('"""A rule reward of a researcher."""\n\n\ndef length_reward(response, answer):\n    return -len(response)\n')
    broken.write_text(open(os.path.join(ROOT, "rloo.py")).read().replace("def main(args):", "def main(args, extra=None):"))
    assert lost_shapes([*TOP_LEVEL, str(helper)]) == []
    assert lost_shapes([str(broken)]) == [str(broken)]


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
            "held_out.py"} <= snapshot, snapshot
    assert "rloo.py" not in snapshot and not re.search(r"vllm|generator", " ".join(snapshot))
    shutil.rmtree(tmp_path / "wandb", ignore_errors=True)


# README's "Add an algorithm" (docs/layout.md), done as a researcher would: REINFORCE++-style advantages (the batch's
# rewards whitened, no per-prompt baseline), an unclipped loss and a halved missing-EOS penalty (an RLHF detail the
# shipped scripts share), in a copy of rloo.py under a new name.
NEW_ALGORITHM = {
    """    rewards = rewards.view(k, -1)
    baseline = (rewards.sum(0, keepdim=True) - rewards) / (k - 1)
    return (rewards - baseline).flatten()""":
    """    return (rewards - rewards.mean()) / (rewards.std() + 1e-8)""",
    "return torch.max(pg_losses, pg_losses_clipped).mean(), log_ratio": "return pg_losses.mean(), log_ratio",
    "return scores + penalty * missing.float()": "return scores + 0.5 * penalty * missing.float()",
}


@pytest.mark.slow
def test_a_new_algorithm_copied_from_a_script_passes_the_quick_tests_with_no_test_edited(tmp_path):
    """The repository's files with the copy beside them: the quick test selection finds it by its shape, holds it to the
    reading order, and passes (the quick tests of every file that finds scripts: by conftest's lists or in the tree);
    the copy runs and learns something different from rloo.py's run."""
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.split()
    tree = tmp_path / "repo"
    for name in listed:
        if os.path.isfile(os.path.join(ROOT, name)):
            os.makedirs(tree / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), tree / name)
    with open(os.path.join(ROOT, "rloo.py")) as f:
        source = f.read()
    for old, new in NEW_ALGORITHM.items():
        assert source.count(old) == 1, old
        source = source.replace(old, new)
    (tree / "reinforce_pp.py").write_text(source)
    finds_scripts = re.compile(r"SCRIPTS|ALGORITHMS|TOP_LEVEL|is_script|ls-files|\*\.py")
    finding = [os.path.join("tests", name) for name in sorted(os.listdir(tree / "tests"))
               if name.startswith("test_") and finds_scripts.search((tree / "tests" / name).read_text())]
    quick = subprocess.run([sys.executable, "-m", "pytest", "-q", "-rA", "-x", "-p", "no:cacheprovider", "-m",
                            "not slow", *finding], cwd=tree, capture_output=True, text=True, timeout=900)
    assert quick.returncode == 0, quick.stdout[-4000:]
    assert quick.stdout.count("reinforce_pp.py") >= 2, quick.stdout[-3000:]  # the layout's tests found it
    arguments = ["--total-episodes", "64", "--per-device-train-batch-size", "16", "--eval-every", "0",
                 "--num-eval-prompts", "8", "--seed", "2"]
    for script in ("reinforce_pp.py", "rloo.py"):
        run([sys.executable, script, *arguments, "--output-dir", str(tmp_path / script)], cwd=tree)
    copied, original = (read_metrics(run_dir_of(str(tmp_path / s))) for s in ("reinforce_pp.py", "rloo.py"))
    assert copied[1]["objective/raw_scores"] == original[1]["objective/raw_scores"]  # the same first batch
    assert copied[1]["loss/policy_avg"] != original[1]["loss/policy_avg"]  # another algorithm learns from them
