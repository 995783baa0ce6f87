"""Helpers shared by the tests: run a script as a user would, read what the run wrote."""

import glob
import json
import math
import os
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "assets", "tiny")
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "assets"))

def pytest_configure(config):
    config.addinivalue_line("markers", "slow: runs a script, a vLLM engine or a build (deselect with -m 'not slow')")


# Keys whose values depend on the wall clock, not on the algorithm.
TIMING_KEYS = ("time/",)


def run(command, timeout=600, env=None, check=True):
    """Run a command from the repository root; fail the test with its output if it fails."""
    full_env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    result = subprocess.run(command, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        pytest.fail(f"{' '.join(command)} exited {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    return result


def run_script(script, *args, **kwargs):
    return run([sys.executable, script, *args], **kwargs)


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
    assert_bad_input_result(run_script(script, *arguments, check=False), time.time() - started, argument)


def assert_bad_input_result(result, seconds, argument):
    assert result.returncode == 2, result.stderr[-2000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: {argument}:"), result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert seconds < 60
