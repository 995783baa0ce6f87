"""The benchmarks keep working: throughput.py's quick mode (no TRL) runs every script on the benchmark's
workload and prints a row of figures for each; weight_sync.py times both weight hand-offs on its smallest
model; tiny_async.py reads back the CSV it writes (to add a seed). No timing is asserted: CI machines differ."""

import os
import sys

import pytest
from conftest import run

pytestmark = pytest.mark.slow  # runs scripts or vLLM engines: minutes

SCRIPTS = ["rloo.py", "online_dpo_vllm.py"]


def test_throughput_quick_mode_prints_episodes_per_second_and_phases_of_every_script():
    # A synchronous and the asynchronous script (all five take about 150 s of CI's 50 minutes): the others are
    # timed by the same code.
    output = run([sys.executable, "benchmark/throughput.py", "--quick", "--scripts", *SCRIPTS], timeout=900).stdout
    rows = {line.split()[0]: line.split()[1:] for line in output.splitlines() if line.split()[:1] in [[s] for s in SCRIPTS]}
    assert sorted(rows) == sorted(SCRIPTS), output
    for script, cells in rows.items():
        eps_min, eps_median, generation, wait, scoring, training, weight_sync, train_gflops = map(float, cells[:8])
        assert 0 < eps_min <= eps_median and cells[8].endswith("%"), (script, cells)
        assert generation > 0 and scoring > 0 and training > 0 and train_gflops > 0, (script, cells)
        # Only the asynchronous script waits for batches and hands weights over.
        assert (weight_sync > 0) == (script == "online_dpo_vllm.py"), (script, cells)
    assert not any(line.startswith("trl") for line in output.splitlines())  # TRL is not installed by CI


def test_weight_sync_benchmark_times_both_hand_offs_and_vllm_gets_the_learners_weights():
    output = run([sys.executable, "benchmark/weight_sync.py", "--sizes", "3M", "--precisions", "fp32", "--repeats",
                  "1"], timeout=600).stdout
    (row,) = [line.split() for line in output.splitlines() if line.split()[:2] == ["3M", "fp32"]]
    seconds = [float(cell.rstrip("s")) for cell in row[3:8]]
    assert all(s > 0 for s in seconds) and seconds[2] == pytest.approx(seconds[0] + seconds[1], abs=2e-3), row
    file_gap, memory_gap = (float(cell.rstrip(",")) for cell in row[10:12])
    assert file_gap < 1e-4 and memory_gap < 1e-4, row  # float32: vLLM's log-probabilities are the learner's


@pytest.mark.parametrize("cuda, trl_arguments", [(True, {"use_cpu": False}), (False, {"use_cpu": True})],
                         ids=["gpu", "cpu"])
def test_trl_runs_on_the_device_our_scripts_run_on(monkeypatch, cuda, trl_arguments):
    """Our scripts train on the GPU when there is one, else on the CPU: TRL's arguments must say the same."""
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmark"))
    import throughput
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert throughput.trl_device() == trl_arguments


def test_tiny_async_reads_back_the_rows_it_writes_so_a_seed_can_be_added(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmark"))
    import tiny_async

    rows = [{"algorithm": "rloo+IS", "k": 8, "seed": 1, "win_rate": 0.73828125, "gold_score": 0.5, "kl": 2.5,
             "perplexity": 8.25, "response_length": 3.75, "seconds": 61.5},  # a row of an older CSV
            {"algorithm": "grpo+IS", "k": 2, "seed": 2, "win_rate": 0.75, "gold_score": 0.5, "kl": 2.5,
             "perplexity": 8.25, "response_length": 3.75, "min_is_ess": 0.9921875, "max_is_truncated": 0.0,
             "seconds": 61.5}]
    tiny_async.write_rows(tmp_path / "tiny_async.csv", rows)
    back = tiny_async.read_rows(tmp_path / "tiny_async.csv")
    assert back[1] == rows[1] and back[0] == {**rows[0], "min_is_ess": "", "max_is_truncated": ""}
