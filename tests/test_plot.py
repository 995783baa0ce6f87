"""benchmark/plot.py on stored outputs: the figure docs/lora.md shows is made again from the runs stored beside it, each
series' points are the stored runs' numbers (their mean and range over seeds), and they are the table stored with the
figure, so a changed stored number fails here."""

import glob
import json
import os
import statistics
import sys

from conftest import ROOT, run

STORED = os.path.join(ROOT, "benchmark", "results")


def printed_series(output):
    """{(label, metric): [[x, mean, lowest, highest], ...]} from plot.py's printed table."""
    found, key = {}, None
    for line in output.splitlines():
        if line.startswith("# ") and " against " in line:
            label, rest = line[2:].split(": ", 1)
            key = (label, rest.split(" against ")[0])
            found[key] = []
        elif line and not line.startswith("#"):
            found[key].append([float(value) for value in line.split()])
    return found


def test_plot_makes_the_lora_figure_from_the_stored_runs(tmp_path):
    with open(os.path.join(STORED, "readme_lora_tiny_plot.txt")) as f:
        stored = f.read()
    command = stored.splitlines()[0].removeprefix("# python ").split()
    out = tmp_path / "figure.png"
    result = run([sys.executable, *command[:command.index("--out")], "--out", str(out)])
    assert out.stat().st_size > 10_000  # a PNG with two panels
    made = printed_series(result.stdout)
    assert made == printed_series(stored)  # the table stored beside the figure
    for label, metric in [("1e-3", "eval/gold_scores"), ("3e-3", "eval/gold_scores"), ("1e-3", "policy/entropy_avg")]:
        runs = []
        for path in glob.glob(os.path.join(STORED, "readme_lora_tiny", f"lr{label}", "*", "metrics.jsonl")):
            with open(path) as f:
                runs.append({row["update"]: row[metric] for row in map(json.loads, f) if metric in row})
        assert len(runs) == (2 if label == "1e-3" else 1)
        expected = [[u, statistics.fmean(r[u] for r in runs), min(r[u] for r in runs), max(r[u] for r in runs)]
                    for u in sorted(set.intersection(*(set(r) for r in runs)))]
        points = made[(label, metric)]
        assert len(points) == len(expected) >= 10
        assert all(abs(a - b) <= 1e-5 * max(1, abs(b)) for p, e in zip(points, expected) for a, b in zip(p, e))
    assert made[("1e-3", "eval/gold_scores")][-1][0] == 1000 and made[("3e-3", "eval/gold_scores")][1][1] < 0.02
