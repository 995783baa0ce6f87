"""Curves of any logged metric of any runs, as a PNG: each series is the runs found under one path (a run directory, a
directory of runs such as an --output-dir, or a metrics.jsonl), their mean and, with several (seeds), the band from
their lowest to their highest, against the update, the episodes or the wall-clock seconds. Runs tracked with wandb
are read the same way: every run writes its metrics.jsonl.

    python benchmark/plot.py runs/ --metric eval/gold_scores                      # every run under runs/
    python benchmark/plot.py "async=runs/a" "sync=runs/s" --metric eval/gold_scores objective/kl --x seconds
    python benchmark/plot.py "1e-3=benchmark/results/readme_lora_tiny/lr1e-3" "3e-3=benchmark/results/readme_lora_tiny/lr3e-3" \\
        --metric eval/gold_scores policy/entropy_avg --out benchmark/results/readme_lora_tiny.png   # docs/lora.md

With --trace it draws, from the runs' trace.json instead, where an update's time goes: for each series a stacked bar
of rank 0's learner track and one of its generator thread's (a *_vllm.py's), each phase's seconds per update (the
runs' mean over their updates but the first, which waits for the first batch, and the last, which holds the final
evaluation), the rest of the update's time on that track as "idle" (the generator's) or "other" (the learner's).

    python benchmark/plot.py rloo_vllm,K=1=benchmark/results/vllm_time_split/rloo_vllm/async --trace --out bars.png

With --by COLUMN the paths are CSV tables, each row one run's final numbers (benchmark/tiny_offpolicy.py's): a series
for each value of the column, its mean at each setting (the first --x column) with its rows' range (seeds) as a bar,
against that setting or the mean of another column there:

    python benchmark/plot.py benchmark/results/tiny_offpolicy.csv --by algorithm --x n kl --metric win_rate --symlog-x

A series is named LABEL=PATH, or by its runs' exp_name. The points plotted are printed as a table.
"""

import argparse
import csv
import glob
import json
import os
import shlex
import statistics
import sys

X_AXES = {"update": "update", "episode": "episodes", "seconds": "wall-clock seconds"}


def run_files(path, name="metrics.jsonl"):
    """The metrics.jsonl (or trace.json) files of the runs under `path`."""
    if os.path.isfile(path):
        return [path]
    return sorted(glob.glob(os.path.join(path, name)) or glob.glob(os.path.join(path, "*", name)))


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


def phase_seconds(path):
    """{(track, phase): seconds per update} of rank 0's tracks in the trace at `path`, over the window from update 2's
    first learner phase to the next-to-last update's end; what no phase of a track covers is its "idle" or "other"."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    tracks = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name" and e["pid"] == 0}
    spans = [e for e in events if e["ph"] == "X" and e["pid"] == 0]
    learner = [e for e in spans if tracks[e["tid"]] == "MainThread" and "update" in e["args"]]
    last = max(e["args"]["update"] for e in learner)
    start = min(e["ts"] for e in learner if e["args"]["update"] == 2)
    end = max(e["ts"] + e["dur"] for e in learner if e["args"]["update"] == last - 1)
    updates = last - 2
    seconds = {}
    for e in spans:
        inside = min(end, e["ts"] + e["dur"]) - max(start, e["ts"])  # the part of it in the window
        if inside > 0:
            key = ("learner" if tracks[e["tid"]] == "MainThread" else tracks[e["tid"]], e["name"])
            seconds[key] = seconds.get(key, 0.0) + inside / 1e6 / updates
    for track in dict.fromkeys(track for track, _ in seconds):
        busy = sum(value for (t, _), value in seconds.items() if t == track)
        seconds[(track, "other" if track == "learner" else "idle")] = (end - start) / 1e6 / updates - busy
    order = list(seconds)  # the learner's track first, each track's phases as they first came, its rest last
    return dict(sorted(seconds.items(), key=lambda item: (item[0][0] != "learner", item[0][0],
                                                          item[0][1] in ("other", "idle"), order.index(item[0]))))


def trace_bars(path):
    """{(track, phase): seconds per update}, the mean over the runs under `path` (a phase a run lacks counts 0)."""
    runs = [phase_seconds(name) for name in run_files(path, "trace.json")]
    keys = list(dict.fromkeys(key for run in runs for key in run))
    return {key: statistics.fmean(run.get(key, 0.0) for run in runs) for key in keys}


def plot_traces(options, plt):
    """The --trace figure: a stacked bar for each series' learner track and generator track, phases coloured alike."""
    bars = [(label, path, trace_bars(path)) for label, path in (label_of(a, "trace.json") for a in options.paths)]
    phases = list(dict.fromkeys(phase for _, _, seconds in bars for _, phase in seconds))
    colours = dict(zip(phases, plt.get_cmap("tab20").colors))
    rows = [(f"{label} {track}", {phase: value for (t, phase), value in seconds.items() if t == track})
            for label, _, seconds in bars for track in dict.fromkeys(t for t, _ in seconds)]
    fig, ax = plt.subplots(figsize=(9, 0.35 * len(rows) + 1.6))
    for y, (name, seconds) in enumerate(rows):
        left = 0.0
        for phase, value in seconds.items():
            ax.barh(y, value, left=left, color=colours[phase], label=phase)
            left += value
    handles = dict(zip(*reversed(ax.get_legend_handles_labels())))  # one legend entry a phase
    ax.legend(handles.values(), handles.keys(), fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))
    ax.set_yticks(range(len(rows)), [name for name, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds per update")
    ax.grid(alpha=0.3, axis="x")
    for label, path, seconds in bars:
        print(f"# {label}: seconds per update by track and phase (mean of {len(run_files(path, 'trace.json'))})")
        for (track, phase), value in seconds.items():
            print(f"{value:.6g} {track}: {phase}")
    return fig


def label_of(argument, name="metrics.jsonl"):
    """A series' label: LABEL of LABEL=PATH (the last "=" splits them), else its runs' exp_name (a run directory's name
    up to its seed)."""
    if "=" in argument:
        return argument.rsplit("=", 1)
    name = os.path.basename(os.path.dirname(run_files(argument, name)[0])) if run_files(argument, name) else argument
    return name.split("__")[0], argument


def table_rows(path):
    """The rows of a CSV table (one a run's final numbers), numbers read as floats."""
    def value(text):
        try:
            return float(text)
        except ValueError:
            return text

    with open(path) as f:
        return [{key: value(text) for key, text in row.items()} for row in csv.DictReader(f)]


def table_points(rows, setting, x, metric):
    """[(x, mean, lowest, highest)] of `metric` over `rows` at each value of the `setting` column (its seeds), in the
    setting's order; x the rows' mean of column `x` there."""
    settings = sorted({row[setting] for row in rows if row.get(metric) != ""})
    groups = [[row for row in rows if row[setting] == value and row.get(metric) != ""] for value in settings]
    return [(statistics.fmean(row[x] for row in group), statistics.fmean(row[metric] for row in group),
             min(row[metric] for row in group), max(row[metric] for row in group)) for group in groups]


def draw_table(options, plt):
    """The --by figure: a panel for each metric and x column; each series (a value of the --by column) its mean at each
    setting (the first --x column) with the range of its rows there (seeds) as a bar."""
    panels = [(metric, x) for metric in options.metric for x in options.x]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.8), squeeze=False)
    setting = options.x[0]
    for (metric, x), ax in zip(panels, axes[0]):
        for path in options.paths:
            rows = table_rows(path)
            for label in dict.fromkeys(row[options.by] for row in rows):
                points = table_points([row for row in rows if row[options.by] == label], setting, x, metric)
                xs, means, lows, highs = map(list, zip(*points))
                ax.errorbar(xs, means, yerr=[[m - lo for m, lo in zip(means, lows)], [h - m for m, h in zip(means, highs)]],
                            marker="o", markersize=3, capsize=2, label=label)
                print(f"# {label}: {metric} against {x} (mean, lowest, highest of the rows at each {setting})")
                for point in points:
                    print(" ".join(f"{value:.6g}" for value in point))
        if x == setting and options.symlog_x:
            ticks = sorted({row[setting] for path in options.paths for row in table_rows(path)})
            ax.set_xscale("symlog", linthresh=1)
            ax.set_xticks(ticks, [f"{tick:g}" for tick in ticks])
        name_axes(ax, options, metric, x, x)
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    return fig


def name_axes(ax, options, metric, x, x_name):
    """A panel's axes named by --xlabel and --ylabel where given, else by the x axis and the metric."""
    ax.set_xlabel(options.xlabel[options.x.index(x)] if options.xlabel else x_name)
    ax.set_ylabel(options.ylabel[options.metric.index(metric)] if options.ylabel else metric)


def draw_curves(options, plt):
    """The runs' figure: a panel for each metric and x axis, each series' mean over its runs and their range as a band."""
    panels = [(metric, x) for metric in options.metric for x in options.x]
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 3.6), squeeze=False)
    for (metric, x), ax in zip(panels, axes[0]):
        for argument in options.paths:
            label, path = label_of(argument)
            points = series(path, metric, x)
            xs, means, lows, highs = zip(*points)
            line, = ax.plot(xs, means, label=f"{label} ({len(run_files(path))} run{'s' * (len(run_files(path)) > 1)})")
            if len(run_files(path)) > 1:
                ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.2, linewidth=0)
            print(f"# {label}: {metric} against {X_AXES[x]} (mean, lowest, highest of {len(run_files(path))})")
            for point in points:
                print(" ".join(f"{value:.6g}" for value in point))
        name_axes(ax, options, metric, x, X_AXES[x])
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    return fig


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", help="[LABEL=]PATH: a run directory, a directory of runs, a metrics.jsonl "
                                                 "(with --by, a CSV table)")
    parser.add_argument("--metric", nargs="+", default=["eval/gold_scores"], help="logged metrics (or columns)")
    parser.add_argument("--x", nargs="+", default=["update"],
                        help=f"x axes, a panel for each metric and x: {', '.join(X_AXES)}; with --by, columns, the "
                             "first the setting whose rows (seeds) make a point")
    parser.add_argument("--by", help="the paths are CSV tables, one row a run's final numbers: a series for each value "
                                     "of this column")
    parser.add_argument("--xlabel", nargs="+", help="the x axes' names, one for each --x")
    parser.add_argument("--ylabel", nargs="+", help="the y axes' names, one for each --metric")
    parser.add_argument("--symlog-x", action="store_true", help="with --by, the setting's axis on a symmetric log scale")
    parser.add_argument("--trace", action="store_true",
                        help="stacked bars of where an update's time goes, from the runs' trace.json")
    parser.add_argument("--out", default="plot.png")
    argv = sys.argv[1:] if argv is None else argv
    options = parser.parse_args(argv)
    if not options.by and set(options.x) - set(X_AXES):
        parser.error(f"--x: choose from {', '.join(X_AXES)}")
    for names, of in ((options.xlabel, options.x), (options.ylabel, options.metric)):
        if names and len(names) != len(of):
            parser.error("--xlabel and --ylabel name each --x and each --metric")
    wanted = "trace.json" if options.trace else "metrics.jsonl"
    for argument in options.paths:
        if not (os.path.isfile(argument) if options.by else run_files(label_of(argument, wanted)[1], wanted)):
            parser.error(f"{argument}: no {'table' if options.by else wanted} there")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    print(f"# python benchmark/plot.py {shlex.join(argv)}")
    draw = plot_traces if options.trace else draw_table if options.by else draw_curves
    save(draw(options, plt), options.out)


def save(fig, out):
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    print(f"# wrote {out}")


if __name__ == "__main__":
    main()
