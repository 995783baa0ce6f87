"""benchmark/gpu_smoke.sh on a machine that lacks packages: each stage imports its packages first and prints one SKIP
line naming those missing (or failing to import), instead of running checks that would all fail. No GPU, no torch:
the Python given is this one without site-packages, with stub packages standing in for the present ones (seconds)."""

import os
import re
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMOKE = os.path.join(ROOT, "benchmark", "gpu_smoke.sh")


def smoke(tmp_path, stages, present=("torch", "transformers", "tyro", "datasets"), broken=(), gpus=1):
    """Runs `gpu_smoke.sh --stage STAGES` with a python3 that has only the `present` packages (empty stubs) and the
    `broken` ones (whose import raises), and an nvidia-smi that lists `gpus` GPUs; returns (exit code, output)."""
    stubs, bin_dir = tmp_path / "stubs", tmp_path / "bin"
    for name in (*present, *broken):
        (stubs / name).mkdir(parents=True)
        (stubs / name / "__init__.py").write_text(f"raise ImportError('{name} is broken here')\n" if name in broken else "")
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')  # -S: no site-packages
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f"echo {i}\n" for i in range(gpus)))
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "PYTHONPATH": str(stubs)}
    env.pop("PYTHON", None)
    env["PYTHON"] = str(bin_dir / "python3")
    result = subprocess.run(["bash", SMOKE, "--stage", stages, str(tmp_path / "out")], env=env, capture_output=True,
                            text=True, timeout=60)
    return result.returncode, result.stdout + result.stderr


def test_a_stage_lacking_packages_says_skip_and_names_them(tmp_path):
    code, output = smoke(tmp_path, "1 2 4 6", broken=("peft",))
    skips = [line for line in output.splitlines() if line.startswith("SKIP")]
    assert skips == [
        "SKIP stage 1: missing deepspeed; cannot import peft (ImportError: peft is broken here)",
        "SKIP stage 2: missing deepspeed",
        *(f"SKIP stage 4{s}: missing deepspeed, vllm, pynvml" for s in "abc"),
        *(f"SKIP stage 4{s}: missing deepspeed, vllm, pynvml; cannot import peft (ImportError: peft is broken here)"
          for s in "defg"),
        "SKIP stage 6: missing deepspeed; cannot import peft (ImportError: peft is broken here); it needs 2 GPU(s), "
        "this machine has 1",
    ], output
    assert "PASS" not in output and "FAIL" not in output and "0 passed, 0 failed" in output
    assert "benchmark/gpu_wheels.sh" in output and code == 0


def test_without_torch_every_package_is_named(tmp_path):
    code, output = smoke(tmp_path, "3", present=(), gpus=0)
    assert [line for line in output.splitlines() if line.startswith("SKIP")] == [
        f"SKIP stage 3{s}: missing torch, transformers, deepspeed, tyro, datasets, vllm, pynvml; it needs 1 GPU(s), "
        "this machine has 0" for s in "ab"], output


def test_unknown_stage_and_missing_python_are_one_line_errors(tmp_path):
    code, output = smoke(tmp_path, "9")
    assert code == 2 and output.strip().startswith("error: no stage 9"), output
    env = {**os.environ, "PYTHON": str(tmp_path / "no_python")}
    result = subprocess.run(["bash", SMOKE, "--stage", "1", str(tmp_path / "out")], env=env, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 2 and "error: no Python at PYTHON=" in result.stderr, result.stderr


def test_no_bare_python_or_deepspeed_launcher():
    """Many GPU images have python3 only, and a `deepspeed` on PATH may belong to another Python: the script runs
    "$PYTHON" and its DeepSpeed's launcher (a function of that name), never a bare `python`."""
    lines = [line for line in open(SMOKE) if not line.lstrip().startswith("#")]
    bare = [line for line in lines if re.search(r"(^|[\s;(&|])python(\s|$)", line)]
    assert not bare, bare
    assert any(line.startswith('deepspeed() { "$PYTHON" -m deepspeed.launcher.runner') for line in lines)


def test_the_header_sizes_every_stage():
    """The header's table of engine starts and minutes covers every stage the script runs, each with a function."""
    text = open(SMOKE).read()
    table = re.search(r"#   stage: +(.*)", text).group(1).split()
    engines = re.search(r"#   vLLM engines: +(.*)", text).group(1).split()
    minutes = re.search(r"#   minutes: +(.*)", text).group(1).split()
    assert table == re.search(r'^all_stages="(.*)"', text, re.M).group(1).split()
    assert len(engines) == len(minutes) == len(table) and max(map(int, engines)) <= 2
    assert all(re.search(rf"^stage{stage}\(\) {{", text, re.M) for stage in table)
