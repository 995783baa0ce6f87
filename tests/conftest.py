"""Helpers shared by the tests: the scripts (found by their shape) and the modules, run a script as a user would,
read what the run wrote."""

import ast
import fcntl
import glob
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "assets"))
# vLLM loads tests/cpu_weight_transfer (its "nccl" weight transfer over gloo) in every process it runs, the scripts'
# too: the in-memory hand-off (--weight-sync memory) on this CPU.
CPU_WEIGHT_TRANSFER = os.path.join(ROOT, "tests", "cpu_weight_transfer")
sys.path.insert(0, CPU_WEIGHT_TRANSFER)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [CPU_WEIGHT_TRANSFER, os.environ.get("PYTHONPATH")]))

SMOLLM2 = os.path.join(ROOT, "assets", "smollm2")

# pytest.ini runs two test processes on this machine's two cores: each computes on one thread, and so does every script
# it runs (torch reads OMP_NUM_THREADS). Two processes of two threads each wait on each other's threads: two rloo.py
# runs of 64 updates side by side took 80 s at two threads each, 42 s at one (one alone, at two threads: 30 s).
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

# The scripts the repository ships: the one list of them, for what only they must meet (their repeated RLHF details
# identical, their arguments' docstrings alike, the runs that test each). Every other test finds scripts by their shape.
SHIPPED = ["rloo.py", "online_dpo.py", "bok.py", "ppo.py", "grpo.py", "tba.py", "rloo_vllm.py", "online_dpo_vllm.py",
           "bok_vllm.py", "ppo_vllm.py", "grpo_vllm.py", "tba_vllm.py", "evaluate.py"]
ALGORITHM_BANNER = "# The algorithm: "  # opens the algorithm's own functions in every algorithm script


def definitions(path):
    """{name: (node, source)} of the top-level functions, classes and assignments of a file (relative to ROOT)."""
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


def is_script(path):
    """A script, by its shape: an `Args` dataclass and `main(args)` at the top level."""
    found = definitions(path)
    args, main = found.get("Args", (None,))[0], found.get("main", (None,))[0]
    return (isinstance(args, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in args.decorator_list)
            and isinstance(main, ast.FunctionDef) and [a.arg for a in main.args.args] == ["args"])


TOP_LEVEL = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "*.py")))
SCRIPTS = [name for name in TOP_LEVEL if is_script(name)]  # the shipped ones and any a researcher adds
# The shipped modules: the machinery every script imports. A researcher's own module beside them (a reward function, an
# environment) is welcome and held to none of their rules.
MODULES = ["checkpoints.py", "checks.py", "data.py", "distributed.py", "generator.py", "held_out.py", "runlog.py",
           "timeline.py", "vllm_engine.py", "weight_handoff.py"]
# Algorithm scripts (not evaluate.py and its copies): those with the algorithm's banner.
ALGORITHMS = [name for name in SCRIPTS if ALGORITHM_BANNER in open(os.path.join(ROOT, name)).read()]


@pytest.fixture(scope="session")
def smollm2():
    """assets/smollm2 (a real pretrained chat model and its arithmetic task), built on first use (about 30 s) by
    whichever test process (pytest.ini runs two) needs it first; the other waits for it."""
    with open(os.path.join(ROOT, "assets", ".smollm2.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(SMOLLM2, "model", "model.safetensors")):
            run([sys.executable, "assets/make_smollm2.py"], timeout=900)
    return SMOLLM2


# pytest.ini runs the tests in two processes, each taking a whole file at a time (a file's module-scoped runs are then
# made once). The longest files go first, so that neither process is left with one at the end.
LONGEST_FIRST = ["test_learning.py", "test_lora.py", "test_scripts_run.py", "test_knobs.py", "test_real_model.py",
                 "test_online_dpo_vllm.py", "test_math_and_chat.py", "test_benchmark.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # (stable: each file's order kept)


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a script, a vLLM engine or a build (deselect with -m 'not slow')")


# Keys whose values depend on the wall clock, not on the algorithm.
TIMING_KEYS = ("time/",)


def run(command, timeout=600, env=None, check=True, cwd=ROOT):
    """Run a command from the repository root (or `cwd`); fail the test with its output if it fails, or if it runs past
    `timeout` seconds: then with where its threads were (SIGABRT makes PYTHONFAULTHANDLER print their stacks)."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", "PYTHONFAULTHANDLER": "1",
                **(env or {})}
    with subprocess.Popen(command, cwd=cwd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as process:
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.send_signal(signal.SIGABRT)
            try:
                stdout, stderr = process.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                stdout, stderr = process.communicate()
            pytest.fail(f"{' '.join(command)} ran past {timeout} s\n{stdout[-4000:]}\n{stderr[-12000:]}")
    result = subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def run_script(script, *args, **kwargs):
    return run([sys.executable, script, *args], **kwargs)


def run_patched(code, *args):
    """`python -c code *args`: a script run with part of it replaced (`code` patches a module, then runs the script
    with runpy), as a user runs it (PYTHONPATH for the modules). The result and the `error:` lines of its stderr."""
    result = run([sys.executable, "-c", code, *args], env={"PYTHONPATH": ROOT}, check=False)
    return result, [line for line in result.stderr.replace("\r", "\n").splitlines() if line.startswith("error:")]


def forked_runs(script, cases, output, env=None, mode="main"):
    """Each of `cases` (argument lists) run as `python script *arguments` would (or, by `mode`, only through its
    validate(), or its `checks` up to the first model's loading: exit code 3 where they pass), forked from one process
    that imported the libraries once (tests/forked_runs.py): a list of (exit code, stdout, stderr, seconds)."""
    run([sys.executable, "tests/forked_runs.py", script, json.dumps(cases), str(output), mode], env=env)
    with open(output) as f:
        return [(r["returncode"], r["stdout"], r["stderr"], r["seconds"]) for r in json.load(f)]


def run_dir_of(output_dir):
    (run_dir,) = glob.glob(os.path.join(output_dir, "*__*"))
    return run_dir


def read_metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def algorithm_metrics(rows):
    """The metrics without the wall-clock ones, for comparing two runs."""
    return [{k: v for k, v in row.items() if not k.startswith(TIMING_KEYS)} for row in rows]


def assert_finite(rows):
    for row in rows:
        for key, value in row.items():
            assert isinstance(value, (int, float)) and math.isfinite(value), f"{key} = {value} at update {row['update']}"


def assert_bad_input(script, arguments, argument):
    """The script must exit 2 within a minute, with exactly one `error: --<argument>: ...` line and no traceback."""
    started = time.time()
    result = run_script(script, *arguments, check=False)
    assert_bad_input_result(result.returncode, result.stderr, time.time() - started, argument)


def assert_bad_input_result(returncode, stderr, seconds, argument):
    assert returncode == 2, stderr[-2000:]
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {argument}:"), stderr[-2000:]
    assert "Traceback" not in stderr
    assert seconds < 60


def bad_path(tmp_path, kind):
    """A path that exists but holds the wrong thing, made under tmp_path/bad."""
    path = tmp_path / "bad" / kind
    path.mkdir(parents=True)
    if kind in ("BAD_DATASET", "EMPTY_SPLIT"):  # no `query` column; an empty test split
        for split in ("train", "test"):
            (path / f"{split}.jsonl").write_text('{"prompt": "hello"}\n' if kind == "BAD_DATASET" else
                                                 '{"query": "hello"}\n' * (split == "train"))
    elif kind in ("NOT_JSON_LINES", "EMPTY_TRAIN_FILE"):  # a train file cut off mid-line; an empty one
        (path / "train.jsonl").write_text('{"query": "hello"}\n{"query": "hel' if kind == "NOT_JSON_LINES" else "")
        (path / "test.jsonl").write_text('{"query": "hello"}\n' * 8)
    elif kind in ("NUMBER_QUERY", "STRING_MESSAGES", "NULL_ANSWER"):  # a row of the wrong type, after good ones
        good, bad = {"NUMBER_QUERY": ({"query": "hello"}, {"query": 12}),
                     "STRING_MESSAGES": ({"messages": [{"role": "user", "content": "hello"}]}, {"messages": "hello"}),
                     "NULL_ANSWER": ({"query": "2 + 3?", "answer": "5"}, {"query": "2 + 4?", "answer": None})}[kind]
        for split in ("train", "test"):
            (path / f"{split}.jsonl").write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    elif kind == "CHAT_DATASET":
        for split in ("train", "test"):
            (path / f"{split}.jsonl").write_text('{"messages": [{"role": "user", "content": "2 + 3?"}], "answer": "5"}\n' * 64)
    elif kind in ("CORRUPT_CONFIG", "NO_TOKENIZER"):
        shutil.copytree(os.path.join(TINY, "sft"), path, dirs_exist_ok=True)
        if kind == "CORRUPT_CONFIG":
            (path / "config.json").write_text('{"model_type": "gpt_neox", ')
        else:
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (path / name).unlink()
    elif kind in ("NOT_JSON", "STAGE_4", "OVERLAP_MAYBE"):  # cut off; a ZeRO stage that does not exist; a setting
        path = path / "zero2.json"  # DeepSpeed's own check rejects
        path.write_text({"NOT_JSON": '{"zero_optimization": {"stage": 2},',
                         "STAGE_4": '{"zero_optimization": {"stage": 4}}',
                         "OVERLAP_MAYBE": '{"zero_optimization": {"stage": 2, "overlap_comm": "maybe"}}'}[kind])
    elif kind == "A_FILE":
        path = os.path.join(TINY, "sft", "config.json")
    elif kind == "PPO_CHECKPOINT":  # a checkpoint written by another script
        (path / "checkpoint-2").mkdir()
        (path / "checkpoint-2" / "trainer_state.json").write_text('{"script": "ppo.py", "update": 2, "episode": 128}')
    elif kind == "BROKEN_CHECKPOINT":  # cut off while written by hand, or by an older version
        (path / "checkpoint-2").mkdir()
        (path / "checkpoint-2" / "trainer_state.json").write_text('{"script": "rloo.py", "upd')
    elif kind in ("RLOO_RUN_K4", "ASYNC_RUN"):  # a run of rloo.py with 4 samples a prompt; an asynchronous one
        script, arguments = ("rloo.py", {"k": 4, "seed": 1, "bf16": False}) if kind == "RLOO_RUN_K4" else \
            ("online_dpo_vllm.py", {"k": 2, "seed": 1, "off_policy_steps": 1, "sync": False})
        (path / "checkpoint-2").mkdir()
        (path / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(
            {"script": script, "update": 2, "episode": 128, "args": arguments}))
        (path / "metrics.jsonl").write_text('{"update": 0}\n{"update": 1}\n{"update": 2}\n')
    return str(path)
