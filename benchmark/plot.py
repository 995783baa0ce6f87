"""Curves of any logged metric of any runs, as a PNG: each series is the runs found under one path (a run directory, a
directory of runs such as an --output-dir, or a metrics.jsonl), their mean and, with several (seeds), the band from
their lowest to their highest, against the update, the episodes or the wall-clock seconds. Runs tracked with wandb
are read the same way: every run writes its metrics.jsonl.

    python benchmark/plot.py runs/ --metric eval/gold_scores                      # every run under runs/
    python benchmark/plot.py "async=runs/a" "sync=runs/s" --metric eval/gold_scores objective/kl --x seconds
    python benchmark/plot.py "1e-3=benchmark/results/readme_lora_tiny/lr1e-3" "3e-3=benchmark/results/readme_lora_tiny/lr3e-3" \\
        --metric eval/gold_scores policy/entropy_avg --out benchmark/results/readme_lora_tiny.png   # docs/lora.md

A series is named LABEL=PATH, or by its runs' exp_name. The points plotted are printed as a table.
"""

import argparse
import glob
import json
import os
import statistics
import sys

X_AXES = {"update": "update", "episode": "episodes", "seconds": "wall-clock seconds"}


def run_files(path):
    """The metrics.jsonl files of the runs under `path`."""
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, "metrics.jsonl")) or glob.glob(os.path.join(path, "*", "metrics.jsonl")))


def x_value(row, x):
    """A logged row's position on the x axis: its update, its episodes, or the seconds since the run started (its
    episodes over its episodes per second so far; 0 before the first update)."""
    if x == "update":
        return row["update"]
    if x == "episode":
        return row.get("episode", 0)
    eps = row.get("time/episodes_per_second")
    return row.get("episode", 0) / eps if eps else 0.0


def series(path, metric, x):
    """[(x, mean, lowest, highest)] of `metric` over the runs under `path`, at each update every run logged it (x the
    runs' mean there)."""
    runs = []
    for name in run_files(path):
        with open(name) as f:
            runs.append({row["update"]: row for row in map(json.loads, f) if metric in row})
    if not runs:
        sys.exit(f"error: {path}: no run logged {metric}")
    updates = sorted(set.intersection(*(set(run) for run in runs)))
    return [(statistics.fmean(x_value(run[u], x) for run in runs), statistics.fmean(run[u][metric] for run in runs),
             min(run[u][metric] for run in runs), max(run[u][metric] for run in runs)) for u in updates]


def label_of(argument):
    """A series' label: LABEL of LABEL=PATH, else its runs' exp_name (a run directory's name up to its seed)."""
    if "=" in argument:
        return argument.split("=", 1)
    name = os.path.basename(os.path.dirname(run_files(argument)[0])) if run_files(argument) else argument
    return name.split("__")[0], argument


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="[LABEL=]PATH: a run directory, a directory of runs, a metrics.jsonl")
    parser.add_argument("--metric", nargs="+", default=["eval/gold_scores"], help="logged metrics, one panel each")
    parser.add_argument("--x", choices=list(X_AXES), default="update")
    parser.add_argument("--out", default="plot.png")
    options = parser.parse_args()
    for argument in options.paths:
        if not run_files(label_of(argument)[1]):
            parser.error(f"{argument}: no metrics.jsonl there")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"# python benchmark/plot.py {' '.join(sys.argv[1:])}")
    fig, axes = plt.subplots(1, len(options.metric), figsize=(5 * len(options.metric), 3.6), squeeze=False)
    for metric, ax in zip(options.metric, axes[0]):
        for argument in options.paths:
            label, path = label_of(argument)
            points = series(path, metric, options.x)
            xs, means, lows, highs = zip(*points)
            line, = ax.plot(xs, means, label=f"{label} ({len(run_files(path))} run{'s' * (len(run_files(path)) > 1)})")
            if len(run_files(path)) > 1:
                ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2, linewidth=0)
            print(f"# {label}: {metric} against {X_AXES[options.x]} (mean, lowest, highest of {len(run_files(path))})")
            for point in points:
                print(" ".join(f"{value:.6g}" for value in point))
        ax.set_xlabel(X_AXES[options.x])
        ax.set_ylabel(metric)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(options.out)), exist_ok=True)
    fig.savefig(options.out, dpi=110)
    print(f"# wrote {options.out}")


if __name__ == "__main__":
    main()
