"""benchmark/plot.py on stored outputs: every figure the README and docs/ show is made again from the outputs stored
beside it (runs' metrics.jsonl, their trace.json, a CSV of final numbers), each series' points are those outputs'
numbers computed here independently, and they are the table stored with the figure, so a changed stored number fails
here. No experiment is rerun."""

import csv
import glob
import importlib.util
import json
import os
import re
import shlex
import statistics

import pytest

from conftest import ROOT

STORED = os.path.join(ROOT, "benchmark", "results")
# Each figure's table: its first line is the command that made the figure (and the table), the rest plot.py's points.
FIGURES = ["readme_async_math_plot.txt", "readme_lora_tiny_plot.txt", "vllm_time_split_plot.txt", "tiny_offpolicy_plot.txt",
           "tiny_async_plot.txt", "readme_async_smollm2_plot.txt", "readme_lora_full_tiny_plot.txt"]
# Points a curve has at least: 10, but SmolLM2's runs of 10 updates, evaluated every 5 (an evaluation there takes
# longer than generating a batch, and --sync's generation hides under it: evaluating every update would hide it all).
FEWEST_POINTS = {"readme_async_smollm2_plot.txt": 3}


def load_plot():
    spec = importlib.util.spec_from_file_location("plot", os.path.join(ROOT, "benchmark", "plot.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def printed_series(output):
    """{series heading: [[value, ...], ...]} from plot.py's printed table (numbers as floats)."""
    found, key = {}, None
    for line in output.splitlines():
        if line.startswith("# ") and ": " in line and not line.startswith(("# python", "# wrote")):
            key = line[2:]
            found[key] = []
        elif line and not line.startswith("#"):
            found[key].append([float(value) if value[0].isdigit() or value[0] == "-" else value
                               for value in line.split()])
    return found


def close(a, b):
    return all(abs(x - y) <= 1e-5 * max(1, abs(y)) for x, y in zip(a, b)) and len(a) == len(b)


def curve_points(files, metric, x):
    """The points of a series of runs computed from their metrics.jsonl: at each update every run logged `metric`, the
    runs' mean x (the update, or seconds: episodes over episodes per second), mean, lowest and highest."""
    runs = []
    for path in files:
        with open(path) as f:
            runs.append({row["update"]: row for row in map(json.loads, f) if metric in row})
    def at(row):
        return row["update"] if x == "update" else row["episode"] / row["time/episodes_per_second"] if row[
            "update"] else 0.0
    return [[statistics.fmean(at(run[u]) for run in runs), statistics.fmean(run[u][metric] for run in runs),
             min(run[u][metric] for run in runs), max(run[u][metric] for run in runs)]
            for u in sorted(set.intersection(*(set(run) for run in runs)))]


def table_points(path, by, label, setting, x, metric):
    """The points of a series of a CSV table computed from its rows: at each setting, the mean of column `x` and the
    mean, lowest and highest of `metric` over the rows there."""
    with open(path) as f:
        rows = [row for row in csv.DictReader(f) if row[by] == label]
    points = []
    for value in sorted({float(row[setting]) for row in rows}):
        here = [row for row in rows if float(row[setting]) == value]
        ys = [float(row[metric]) for row in here]
        points.append([statistics.fmean(float(row[x]) for row in here), statistics.fmean(ys), min(ys), max(ys)])
    return points


def option(argv, name):
    """The values of a plot.py option in `argv` (up to the next option)."""
    if name not in argv:
        return []
    values = argv[argv.index(name) + 1:]
    return values[:next((i for i, v in enumerate(values) if v.startswith("--")), len(values))]


@pytest.mark.parametrize("name", FIGURES)
def test_each_figure_is_made_again_from_its_stored_outputs(name, tmp_path, capsys):
    with open(os.path.join(STORED, name)) as f:
        stored = f.read()
    argv = shlex.split(stored.splitlines()[0].removeprefix("# python benchmark/plot.py "))
    figure = option(argv, "--out")[0]
    assert os.path.exists(os.path.join(ROOT, figure)), figure
    # the figure is shown with the command beside it, in the README or a doc
    shown = [path for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]
             if os.path.basename(figure) + ")" in open(path).read()]
    assert shown and all(f"--out {figure}" in " ".join(open(path).read().replace("\\\n", " ").split())
                         for path in shown), (figure, shown)

    out = tmp_path / "figure.png"
    argv[argv.index("--out") + 1] = str(out)
    load_plot().main(argv)
    made = printed_series(capsys.readouterr().out)
    assert out.stat().st_size > 10_000
    assert made == printed_series(stored)  # the table stored beside the figure

    paths = [argument for argument in argv[:next(i for i, v in enumerate(argv) if v.startswith("--"))]]
    if "--trace" in argv:  # per series, the learner's training seconds per update: its mean over updates 2 to last - 1
        for argument in paths:
            label, path = argument.rsplit("=", 1)
            runs = []
            for trace in glob.glob(os.path.join(ROOT, path, "*", "trace.json")):
                spans = [e for e in json.load(open(trace))["traceEvents"] if e["ph"] == "X" and e["pid"] == 0]
                last = max(e["args"].get("update", 0) for e in spans if e["tid"] == 0)
                runs.append(sum(e["dur"] for e in spans if e["tid"] == 0 and e["name"] == "train"
                                and 2 <= e["args"]["update"] <= last - 1) / 1e6 / (last - 2))
            (heading,) = [key for key in made if key.startswith(f"{label}: ")]
            bars = {" ".join(row[1:]): row[0] for row in made[heading]}
            assert abs(bars["learner: train"] - statistics.fmean(runs)) < 1e-5, (label, bars, runs)
            tracks = {phase.split(":")[0] for phase in bars}
            totals = {track: sum(v for phase, v in bars.items() if phase.startswith(track + ":")) for track in tracks}
            assert len(tracks) == 2 and max(totals.values()) - min(totals.values()) < 1e-4, totals  # one update's time
        return
    for metric in option(argv, "--metric"):
        for x in option(argv, "--x"):
            if "--by" in argv:
                (table,) = paths
                by, setting = option(argv, "--by")[0], option(argv, "--x")[0]
                with open(os.path.join(ROOT, table)) as f:
                    labels = list(dict.fromkeys(row[by] for row in csv.DictReader(f)))
                for label in labels:
                    expected = table_points(os.path.join(ROOT, table), by, label, setting, x, metric)
                    (heading,) = [k for k in made if k.startswith(f"{label}: {metric} against {x} ")]
                    assert len(made[heading]) == len(expected) >= 2
                    assert all(close(p, e) for p, e in zip(made[heading], expected)), (label, made[heading], expected)
                continue
            for argument in paths:
                label, path = argument.rsplit("=", 1)
                files = glob.glob(os.path.join(ROOT, path, "*", "metrics.jsonl"))
                expected = curve_points(files, metric, x)
                (heading,) = [k for k in made if k.startswith(f"{label}: {metric} against {load_plot().X_AXES[x]} (")]
                assert len(made[heading]) == len(expected) >= FEWEST_POINTS.get(name, 10)
                assert all(close(p, e) for p, e in zip(made[heading], expected)), (label, made[heading], expected)


def test_the_figures_show_what_they_claim():
    """The numbers the captions state, read from the stored tables: the LoRA command at 1e-3 learns over its 1,000
    updates while 3e-3 collapses, and full fine-tuning learns as fast at 1e-3, far slower at 2e-5 (docs/lora.md); on
    the math task online DPO's asynchronous curve reaches 0.75 at 12.2 s against --sync's 17.3 s, and RLOO's
    asynchronous runs end at 99.5 s after 32,000 episodes against --sync's 99.2 s after 25,600: 1.25x the episodes a
    second, though it reached 0.75 at 26.9 s against 20.2 s and its first 100 updates took 32.1 s against 25.8 s (the
    README and docs/results.md); on SmolLM2 RLOO's asynchronous runs ended at 0.625 after 197 s, --sync's at 0.693
    after 211 s, and stood at 0.516 after 98 s and 0.620 after 102 s at update 5 (docs/results.md)."""
    def stored(name):
        with open(os.path.join(STORED, name)) as f:
            return {key.split(" against ")[0]: points for key, points in printed_series(f.read()).items()}

    lora = stored("readme_lora_tiny_plot.txt")
    assert lora["1e-3: eval/gold_scores"][-1][0] == 1000 and lora["3e-3: eval/gold_scores"][1][1] < 0.02
    # LoRA against full fine-tuning (docs/lora.md): at 2e-5 past 0.9 first at update 300, at 1e-3 as fast as the
    # adapter (0.94 by update 20) and ahead of it by 0.008 on the mean from update 100 on; their ends
    full = stored("readme_lora_full_tiny_plot.txt")
    adapter, full_1e3, full_2e5 = (full[f"{label}: eval/gold_scores"] for label in (
        "LoRA rank 8, 1e-3", "full fine-tuning, 1e-3", "full fine-tuning, 2e-5"))
    assert next(update for update, mean, _, _ in full_2e5 if mean >= 0.9) == 300
    assert [round(points[1][1], 2) for points in (adapter, full_1e3)] == [0.95, 0.94]
    ahead = [b[1] - a[1] for a, b in zip(adapter, full_1e3) if a[0] >= 100]
    assert round(statistics.fmean(ahead), 3) == 0.008 and sum(d > 0 for d in ahead) == 44 and len(ahead) == 46
    assert [round(points[-1][1], 3) for points in (adapter, full_1e3, full_2e5)] == [0.976, 0.982, 0.946]
    math = stored("readme_async_math_plot.txt")
    math = {label.removesuffix(": eval/scores"): points for label, points in math.items()}
    reached = {label: next(x for x, mean, _, _ in math[label] if mean >= 0.75)
               for label in ("online DPO, async K = 1", "online DPO, --sync")}
    assert [round(seconds, 1) for seconds in reached.values()] == [12.2, 17.3]
    (rloo_async, rloo_sync) = (math["RLOO, async K = 1"][-1][0], math["RLOO, --sync"][-1][0])
    assert (round(rloo_async, 1), round(rloo_sync, 1)) == (99.5, 99.2)
    assert round(32000 / rloo_async / (25600 / rloo_sync), 2) == 1.25
    reached = {label: next(x for x, mean, _, _ in math[label] if mean >= 0.75)
               for label in ("RLOO, async K = 1", "RLOO, --sync")}
    assert [round(seconds, 1) for seconds in reached.values()] == [26.9, 20.2]
    # RLOO's first 100 updates (the sixth evaluation) took longer asynchronously
    assert (round(math["RLOO, async K = 1"][5][0], 1), round(math["RLOO, --sync"][5][0], 1)) == (32.1, 25.8)
    # SmolLM2 (docs/results.md): the mean accuracy and the loop's seconds at updates 0, 5 and 10, both modes
    with open(os.path.join(STORED, "readme_async_smollm2_plot.txt")) as f:
        smollm2 = printed_series(f.read())
    curves = {label: [(round(x), round(mean, 3)) for x, mean, _, _ in
                      smollm2[f"{label}: eval/scores against wall-clock seconds (mean, lowest, highest of 2)"]]
              for label in ("RLOO, async K = 1", "RLOO, --sync")}
    assert curves == {"RLOO, async K = 1": [(0, 0.26), (98, 0.516), (197, 0.625)],
                      "RLOO, --sync": [(0, 0.26), (102, 0.62), (211, 0.693)]}, curves


def test_where_an_updates_time_goes_from_a_trace(tmp_path):
    """plot.py --trace's numbers by hand: updates 1-4, each learner update taking its batch for 2 s and training for 7 s
    from second 10 x update; the window runs from update 2's start (20 s) to update 3's end (39 s), 9.5 s an update.
    The generator generated 20-22, 25-32 and 35-39 s of it (6.5 s an update), loaded a version 32-33 s (0.5)."""
    def span(name, start, end, tid, **args):
        return {"name": name, "ph": "X", "ts": start * 10 ** 6, "dur": (end - start) * 10 ** 6, "pid": 0, "tid": tid,
                "args": args}

    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
              for tid, name in [(0, "MainThread"), (1, "generator")]]
    for update in range(1, 5):
        events += [span("take the batch", 10 * update, 10 * update + 2, 0, update=update),
                   span("train", 10 * update + 2, 10 * update + 9, 0, update=update)]
    events += [span("generate a batch", start, start + 7, 1, update=update) for update, start in [(2, 15), (3, 25),
                                                                                                   (4, 35)]]
    events.append(span("load a version", 32, 33, 1, version=3))
    with open(tmp_path / "trace.json", "w") as f:
        json.dump({"traceEvents": events}, f)
    assert load_plot().phase_seconds(str(tmp_path / "trace.json")) == {
        ("learner", "take the batch"): 2.0, ("learner", "train"): 7.0, ("learner", "other"): 0.5,
        ("generator", "generate a batch"): 6.5, ("generator", "load a version"): 0.5, ("generator", "idle"): 2.5}


def test_every_figure_of_the_readme_and_docs_is_tested_here():
    """A picture added to README.md or docs/ without its table in FIGURES would go unchecked."""
    shown = set()
    for path in [os.path.join(ROOT, "README.md"), *glob.glob(os.path.join(ROOT, "docs", "*.md"))]:
        shown |= {os.path.basename(name) for name in re.findall(r"!\[[^]]*\]\(([^)]+\.png)\)", open(path).read())}
    made = set()
    for name in FIGURES:
        with open(os.path.join(STORED, name)) as f:
            made.add(os.path.basename(option(shlex.split(f.readline().removeprefix("# python benchmark/plot.py ")),
                                             "--out")[0]))
    assert shown == made, (shown, made)
