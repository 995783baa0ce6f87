"""The tables of docs/results.md, performance.md, math.md, lora.md and six per-script docs against the stored outputs they come from
(benchmark/results/; the math asset's build statistics): every numeric cell is recomputed from its output file and
rounded as the doc rounds, so a rerun that changes a number fails the doc's row until the doc is updated. Every
table of a doc is checked or listed in UNCHECKED with the reason. (README.md's table lists scripts; its measured figures are in sentences, which
this test does not read.)"""

import ast
import csv
import json
import os
import re
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmark", "results")


def read(name):
    with open(os.path.join(RESULTS, name)) as f:
        return f.read()


def rounded(value, places):
    """`value` (a float, a Fraction or a decimal string, each taken exactly) to `places` decimals, halves up."""
    value = Fraction(value)
    exact = Decimal(value.numerator) / Decimal(value.denominator)
    return str(exact.quantize(Decimal(1).scaleb(-places), rounding=ROUND_HALF_UP))


def signed(value, places):
    """`rounded`, with its sign (a gain of points)."""
    text = rounded(value, places)
    return text if text.startswith("-") else "+" + text


def markdown_tables(lines):
    """Every table of markdown `lines`: (its header's cells, {row label: the row's cells}), in order."""
    tables, block = [], []
    for line in [*lines, ""]:
        line = line.strip()
        if line.startswith("|") and line.endswith("|"):
            block.append([cell.strip() for cell in line[1:-1].split("|")])
        elif block:
            tables.append((block[0], {row[0]: row for row in block[2:]}))  # block[1] is the |---| line
            block = []
    return tables


def doc_tables(doc):
    """Every table of docs/`doc`."""
    with open(os.path.join(ROOT, "docs", doc)) as f:
        return markdown_tables(f)


# --- Figure 4 in miniature and with real asynchrony: means over the seeds of a CSV of benchmark/tiny_*.py ---

ALGORITHMS = {"online DPO": "online_dpo", "PPO": "ppo", "PPO + IS": "ppo+IS", "RLOO": "rloo", "RLOO + IS": "rloo+IS",
              "best-of-2": "bok", "GRPO": "grpo", "GRPO + IS": "grpo+IS", "DAPO + IS": "dapo+IS",
              "TBA": "tba"}


def tiny_csv(name, knob):
    """'mean win rate (mean KL)' over the seeds of one algorithm and value of the knob (N or K), as the
    benchmark prints it; empty where the CSV has no run."""
    with open(os.path.join(RESULTS, name)) as f:
        rows = list(csv.DictReader(f))

    def cell(label, column):
        knob_value = re.fullmatch(r"[NK] = (\d+)( \(sync\))?", column)
        if not knob_value:
            raise KeyError(column)
        runs = [row for row in rows if row["algorithm"] == ALGORITHMS[label] and int(row[knob]) == int(knob_value[1])]
        if not runs:
            return ""
        win_rate = sum(float(row["win_rate"]) for row in runs) / len(runs)
        kl = sum(float(row["kl"]) for row in runs) / len(runs)
        return f"{rounded(win_rate, 3)} ({rounded(kl, 1)})"
    return cell


# --- benchmark/async_speedup.py's outputs ---

def speedup_output(text):
    """One script's part of an async_speedup.py output: per mode its columns, its final accuracy by seed (as
    printed; only with several seeds) and its accuracy curve [(loop seconds, accuracy)], as printed."""
    header = re.search(r"^ {8}( +loop seconds.*)$", text, re.M).group(1)
    names = [header[i:i + 17].strip() for i in range(0, len(header), 17)]  # 17 characters a column, as printed
    out = {}
    for mode in ("sync", "async"):
        values = re.search(rf"^{mode} +([\d. ]+)$", text, re.M).group(1).split()
        seeds = re.search(rf"^{mode} final scores by seed: (.*)$", text, re.M)
        curve = re.search(rf"^{mode} +accuracy against loop seconds: (.*)$", text, re.M).group(1).split()
        out[mode] = {"columns": dict(zip(names, values)), "seeds": seeds and seeds.group(1).split(", "),
                     "curve": [tuple(point.split("s:")) for point in curve]}
    reached = re.search(r"first at the sync run's final accuracy, [\d.]+: sync ([\d.]+) s, async ([\d.]+|never)", text)
    out["sync reached"], out["async reached"] = reached.groups()
    return out


def exact(accuracy, prompts):
    """A printed accuracy as the fraction it is: greedy answers scored 0 or 1, so k / prompts (the printout has 3
    decimals; gains computed from it would round twice)."""
    k = round(float(accuracy) * prompts)
    assert abs(Fraction(accuracy) - Fraction(k, prompts)) <= Fraction(1, 2000), (accuracy, prompts)
    return Fraction(k, prompts)


def gain(finals, start):
    """'+mean (+seed 1, +seed 2)' in points of accuracy."""
    gains = [(final - start) * 100 for final in finals]
    return f"{signed(sum(gains) / len(gains), 1)} ({', '.join(signed(g, 1) for g in gains)})"


def smollm2_run(name):
    """One SmolLM2 table of results.md's list: rows `--sync` and async K = 1 of one output."""
    output = speedup_output(read(name))
    modes = {"`--sync`": output["sync"], "async K = 1": output["async"]}
    columns = {
        "final accuracy, seed 1, seed 2": lambda mode: ", ".join(mode["seeds"]),
        "gain, mean (each)": lambda mode: gain([exact(seed, 96) for seed in mode["seeds"]],
                                               exact(mode["curve"][0][1], 96)),
        "mean curve (start -> 5 -> 10)": lambda mode: " -> ".join(accuracy for _, accuracy in mode["curve"]),
        "episodes/s": lambda mode: mode["columns"]["episodes/s"],
    }
    return lambda label, column: columns[column](modes[label])


def smollm2_lr3e6():
    """The lr 3e-6 table: each seed's run in its own output."""
    outputs = {script: [speedup_output(read(f"async_speedup_smollm2_{script}{seed}.txt")) for seed in ("", "_seed2")]
               for script in ("rloo", "online_dpo")}
    rows = {"`rloo_vllm.py --sync`": ("rloo", "sync"), "`rloo_vllm.py`, async K = 1": ("rloo", "async"),
            "`online_dpo_vllm.py --sync`": ("online_dpo", "sync"),
            "`online_dpo_vllm.py`, async K = 1": ("online_dpo", "async")}
    columns = {
        "greedy test accuracy, seed 1 (start -> update 5 -> 10)":
            lambda runs: " -> ".join(accuracy for _, accuracy in runs[0]["curve"]),
        "seed 2": lambda runs: " -> ".join(accuracy for _, accuracy in runs[1]["curve"]),
        "gain, mean of 2 (each)": lambda runs: gain([exact(run["curve"][-1][1], 96) for run in runs],
                                                    exact(runs[0]["curve"][0][1], 96)),
        "episodes/s (seed 1, 2)": lambda runs: ", ".join(run["columns"]["episodes/s"] for run in runs),
    }

    def cell(label, column):
        script, mode = rows[label]
        return columns[column]([output[mode] for output in outputs[script]])
    return cell


def hf_scripts():
    """smollm2_hf_scripts.txt and smollm2_hf_tba.txt: {script: [(update, accuracy), ...] per seed}."""
    runs, text = {}, read("smollm2_hf_scripts.txt") + read("smollm2_hf_tba.txt")
    for script, seed, curve in re.findall(r"^(\w+) seed (\d) .*?: (\[.*\])$", text, re.M):
        runs.setdefault(script, {})[int(seed)] = ast.literal_eval(curve)
    return runs


def smollm2_recipe():
    """The recipe's summary: each algorithm's `*_vllm.py` in both modes (async_speedup.py's outputs) and its
    HF-generation sibling (smollm2_hf_*.txt), 'mean (seed 1, seed 2)' of the final accuracy."""
    # The outputs' names: async_speedup_smollm2_<name>_lr1e-5.txt and <name> in smollm2_hf_scripts.txt.
    names = {"RLOO": "rloo", "online DPO": "online_dpo", "PPO": "ppo", "best of 4 (`bok`)": "bok", "GRPO": "grpo",
             "DAPO (`grpo --loss-type dapo --cliprange-high 0.28`, beta 0.04, before DAPO's defaults)": "dapo",
             "TBA": "tba"}
    hf = hf_scripts()

    def vllm(name):
        return speedup_output(read(f"async_speedup_smollm2_{name}_lr1e-5.txt"))

    columns = {
        "`*_vllm.py --sync`": lambda name: vllm(name)["sync"]["seeds"],
        "`*_vllm.py` async K = 1": lambda name: vllm(name)["async"]["seeds"],
        "HF generation (`rloo.py`, ...)": lambda name: [f"{hf[name][seed][-1][1]:.3f}" for seed in (1, 2)],
    }

    def cell(label, column):
        seeds = columns[column](names[label])
        mean = sum(exact(seed, 96) for seed in seeds) / 2
        return f"{rounded(mean, 3)} ({', '.join(seeds)})"
    return cell


def speedup_parts(name):
    """{label: per mode its columns, and the speed-up} of a tiny-task async_speedup.py output, one part per script
    and command; the label is the script, with the command's `--k` where it gives one."""
    outputs = {}
    for command in re.split(r"^# python benchmark/async_speedup\.py", read(name), flags=re.M)[1:]:
        k = re.search(r"--k (\d+)", command.splitlines()[0])
        for part in re.split(r"^(?=running \S+ sync seed 1 )", command, flags=re.M)[1:]:  # [0]: the command
            header = re.search(r"^ {8}( +loop seconds.*)$", part, re.M).group(1)
            names = [header[i:i + 17].strip() for i in range(0, len(header), 17)]
            modes = {mode: dict(zip(names, re.search(rf"^{mode} +([-\d. ]+)$", part, re.M).group(1).split()))
                     for mode in ("sync", "async")}
            modes["speed-up"] = re.search(r"^async speed-up .*: ([\d.]+x)$", part, re.M).group(1)
            script = part.split()[1]
            outputs[f"`{script}.py`" + (f", k = {k.group(1)}" if k else "")] = modes
    return outputs


def speedup_table(name, labels=lambda label: label):
    """A speed-up table of the tiny task: each row's label, through `labels`, names its part of the output."""
    outputs = speedup_parts(name)

    def idle(mode):
        return f"{rounded(Fraction(mode['learner idle']) * 100, 1)} %"
    columns = {
        "sync loop": lambda o: f"{rounded(o['sync']['loop seconds'], 1)} s",
        "async loop": lambda o: f"{rounded(o['async']['loop seconds'], 1)} s",
        "speed-up": lambda o: o["speed-up"],
        "learner idle sync -> async": lambda o: f"{idle(o['sync'])} -> {idle(o['async'])}",
        "gold sync / async (start 0.201)": lambda o: f"{o['sync']['gold score']} / {o['async']['gold score']}",
    }
    return lambda label, column: columns[column](outputs[labels(label)])


def default_run_parts():
    """{`script.py`: ({update: its logged row, as printed}, the process's seconds)} of default_runs.txt."""
    outputs = {}
    for part in read("default_runs.txt").strip().split("\n\n")[1:]:  # [0]: the command
        name, seconds = re.search(r"^(\w+\.py): ([\d.]+) s in all", part, re.M).groups()
        lines = [line.split() for line in part.splitlines() if line.startswith("  ")]
        rows = {row[0]: dict(zip(lines[0], row)) for row in lines[1:] if row[0].isdigit()}
        outputs[f"`{name}`"] = rows, int(rounded(seconds, 0))
    return outputs


def default_runs():
    """The default-run table: default_runs.txt's part per script, its evaluations at updates 300 and 1000."""
    outputs = default_run_parts()

    def kl(row):
        return rounded(row["pairs/kl"] if "pairs/kl" in row else row["objective/kl"], 1)
    columns = {
        "gold at 19,200 episodes": lambda rows, _: rounded(rows["300"]["eval/gold_scores"], 3),
        "gold at 64,000": lambda rows, _: rounded(rows["1000"]["eval/gold_scores"], 3),
        "KL at the end": lambda rows, _: kl(rows["1000"]),
        "wall clock (the process)": lambda _, seconds: f"{seconds // 60} min {seconds % 60} s",
    }
    return lambda label, column: columns[column](*outputs[label])


def math_task():
    """The math task's table (3 seeds, 288 test problems): one part of the output per script."""
    parts = re.split(r"\n\n(?=running )", read("async_speedup_math.txt"))
    outputs = {f"`{part.split()[1]}.py`": speedup_output(part) for part in parts}

    def speed_up(output, sync, asynchronous):
        ratio = Fraction(asynchronous["episodes/s"]) / Fraction(sync["episodes/s"])
        return (f"{rounded(ratio, 2)}x ({rounded(sync['episodes/s'], 0)} -> "
                f"{rounded(asynchronous['episodes/s'], 0)} episodes/s)")

    def sooner(output, sync, asynchronous):
        reached = Fraction(output["async reached"])
        return (f"{rounded(Fraction(output['sync reached']) / reached, 2)}x / "
                f"{rounded(Fraction(sync['loop seconds']) / reached, 2)}x")
    columns = {
        "throughput speed-up": speed_up,
        "sync: final accuracy, loop time": lambda output, sync, _: (
            f"{sync['accuracy']} ({', '.join(output['sync']['seeds'])}), {rounded(sync['loop seconds'], 1)} s"),
        "async reaches it at": lambda output, *_: f"{output['async reached']} s",
        "async sooner than sync reached it / than sync ended": sooner,
        "async's own end": lambda output, _, asynchronous: (
            f"{asynchronous['accuracy']} at {rounded(asynchronous['loop seconds'], 1)} s"),
    }

    def cell(label, column):
        output = outputs[label]
        return columns[column](output, output["sync"]["columns"], output["async"]["columns"])
    return cell


# A table is named by its header's first two cells. The two Figure-4 tables with real asynchrony share a header
# and a CSV (their rows differ).
CHECKED = {
    ("algorithm", "N = 1"): lambda: tiny_csv("tiny_offpolicy.csv", "n"),
    ("algorithm", "K = 0 (sync)"): lambda: tiny_csv("tiny_async.csv", "k"),
    ("script", "throughput speed-up"): math_task,
    ("script", "sync loop"): lambda: speedup_table("async_speedup_tiny.txt"),
    ("script, settings", "sync loop"):  # k = 2 is the scripts' default
        lambda: speedup_table("async_speedup_tiny_heavier.txt", lambda label: label.removesuffix(", k = 2")),
    ("script", "gold at 19,200 episodes"): default_runs,
    ("algorithm", "`*_vllm.py --sync`"): smollm2_recipe,
    ("script, 10 updates", "greedy test accuracy, seed 1 (start -> update 5 -> 10)"): smollm2_lr3e6,
    ("`rloo_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_rloo_lr1e-5.txt"),
    ("`online_dpo_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_online_dpo_lr1e-5.txt"),
    ("`ppo_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_ppo_lr1e-5.txt"),
    ("`bok_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_bok_lr1e-5.txt"),
    ("`grpo_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_grpo_lr1e-5.txt"),
    ("`grpo_vllm.py --loss-type dapo`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_dapo_lr1e-5.txt"),
}

UNCHECKED = {
    ("", "paper (TL;DR, Pythia 2.8b, 4 x A100)"):
        "the paper's figures beside ours in words; ours are the speed-up tables below it",
}


# --- docs/performance.md: throughput.py's and weight_sync.py's outputs ---

def throughput_rows(text):
    """{system: {column: the printed figure}} of each table a throughput.py output prints (fixed-width columns)."""
    widths = [("eps min", 9), ("median", 9), ("x TRL", 7), ("", 3), ("gen", 6), ("wait", 6), ("score", 6),
              ("train", 6), ("sync", 6), ("", 3), ("train GFLOP/s", 13), ("of peak", 8)]
    rows = {}
    for line in text.splitlines():
        if re.match(r"^(\S+\.py|trl \w+) {2,}[\d.]", line):
            start, row = 22, {}
            for name, width in widths:
                row[name] = line[start:start + width].strip()
                start += width
            rows[line[:22].strip()] = row
    return rows


def throughput():
    """The throughput table: throughput_tiny_fp32.txt, one row per system; HF generation has no wait or sync."""
    rows = throughput_rows(read("throughput_tiny_fp32.txt"))
    columns = {"eps min": "eps min", "eps median": "median", "x TRL": "x TRL", "generation s": "gen", "wait s": "wait",
               "scoring s": "score", "training s": "train", "weight sync s": "sync",
               "training GFLOP/s": "train GFLOP/s", "of peak": "of peak"}

    def cell(label, column):
        system = label.strip("`").replace("TRL ", "trl ")
        value = rows[system][columns[column]]
        if column in ("wait s", "weight sync s") and "vllm" not in system and value == "0.000":
            return ""
        return value.replace("%", " %")
    return cell


def optimisations():
    """The before/after table: the episodes/s median of each invocation in throughput_optimisations.txt, in order."""
    runs = {"before": [], "after": []}
    for when, part in re.findall(r"^## (before|after) \(\d\)\n(.*?)(?=^## |\Z)", read("throughput_optimisations.txt"),
                                 re.M | re.S):
        runs[when].append(throughput_rows(part))
    return lambda label, column: ", ".join(rows[column.split()[0]]["median"] for rows in runs[label])


def weight_sync():
    """The hand-off table: weight_sync.txt's row of each model and dtype, its figures as printed."""
    rows = {}
    for line in read("weight_sync.txt").splitlines()[2:]:
        model, dtype, params, *seconds, learner, total, gap_file, gap_memory = line.split()
        rows[f"{params[:-1]} M, {dtype}"] = [*(value[:-1] + " s" for value in seconds), learner, total,
                                             gap_file + " " + gap_memory]
    names = {name: i for i, name in enumerate(["file: learner", "file: generator", "file: total", "memory: learner",
                                                "memory: total", "learner speed-up", "total speed-up",
                                                "log-prob gap file, memory"])}
    return lambda label, column: rows[label][names[column]]


# --- docs/math.md: the math task's asset and math_curves.txt ---

def math_sft():
    """The SFT policy's accuracies, from the asset's build (assets/tiny_math/build_stats.json)."""
    with open(os.path.join(ROOT, "assets", "tiny_math", "build_stats.json")) as f:
        stats = json.load(f)
    keys = {("accuracy, all problems", "greedy"): "sft_greedy_accuracy",
            ("accuracy, all problems", "sampled at temperature 0.7"): "sft_sampled_accuracy",
            ("accuracy, the 159 problems with a carry or borrow", "greedy"): "sft_greedy_accuracy_carry",
            ("accuracy, the 159 problems with a carry or borrow", "sampled at temperature 0.7"):
                "sft_sampled_accuracy_carry"}
    return lambda label, column: rounded(repr(stats[keys[label, column]]), 3)


def math_curves():
    """Each script's accuracies at the table's updates and its process's seconds, from math_curves.txt."""
    runs = {}
    for line in read("math_curves.txt").splitlines():
        if line.startswith("#"):
            continue
        seconds = re.search(r"([\d.]+) s in all", line).group(1)
        runs[line[:line.index(" (exit")]] = dict(ast.literal_eval(line[line.index("[("):])), seconds

    def cell(label, column):
        accuracies, seconds = runs[label.split("`")[1]]
        if column == "wall clock, in all":
            return f"{rounded(seconds, 0)} s"
        return rounded(repr(accuracies[int(column)]), 3)
    return cell


MATH_CHECKED = {
    ("SFT policy on the 288 test problems", "greedy"): math_sft,
    ("script", "0"): math_curves,
}
PERFORMANCE_CHECKED = {
    ("script, fp32", "eps min"): throughput,
    ("", "rloo.py fp32"): optimisations,
    ("model (parameters), dtype", "file: learner"): weight_sync,
}
# --- docs/lora.md: benchmark/lora_sizes.py's table, lora_cost.py's lines, async_speedup.py's LoRA runs ---

def lora_sizes():
    """The table lora_sizes.py prints, cell for cell."""
    ((header, rows),) = markdown_tables(read("lora_sizes.txt").splitlines())
    return lambda label, column: rows[label][header.index(column)]


def lora_cost():
    text = read("lora_cost.txt")
    rloo = {mode: re.search(rf"^rloo.py {mode}: learner peak resident memory ([\d.]+) GiB; ([\d.]+) episodes/s", text,
                            re.M).groups() for mode in ("full", "LoRA")}
    vllm = {mode: re.search(rf"^rloo_vllm.py {mode}: hand-off as files: .*?([\d.]+) MiB; per update .* the learner's "
                            rf"side ([\d.]+) s, .*; ([\d.]+) episodes/s", text, re.M).groups() for mode in ("full", "LoRA")}
    loads = dict(zip(("LoRA", "full"), re.search(r"the adapter ([\d.]+) s, the full weights ([\d.]+) s", text).groups()))
    rows = {"`rloo.py`: the learner's peak resident memory (GiB)": lambda mode: rloo[mode][0],
            "`rloo.py`: episodes/s": lambda mode: rloo[mode][1],
            "`rloo_vllm.py`: a hand-off (MiB)": lambda mode: vllm[mode][0],
            "`rloo_vllm.py`: the learner's side of a hand-off (s)": lambda mode: vllm[mode][1],
            "vLLM loading a new version (s)": lambda mode: loads[mode],
            "`rloo_vllm.py` (one update late): episodes/s": lambda mode: vllm[mode][2]}
    modes = {"full fine-tuning": "full", "LoRA, rank 16": "LoRA"}
    return lambda label, column: rows[label](modes[column])


# --- the per-script docs: each one's default run (default_runs.txt), rloo_vllm.md's run (script_docs_runs.txt) and
# online_dpo_vllm.md's speed-up (async_speedup_tiny.txt) ---

def script_default_run(script):
    """A script doc's table of its default run, one row per update as default_runs.py logged it."""
    rows, _ = default_run_parts()[f"`{script}`"]

    def number(value, places):
        return "" if value == "-" else rounded(value, places)

    def kl(value):  # at update 0 none is logged: the policy is the reference
        return "0" if value in ("-", "0") else rounded(value, 2 if float(value) < 10 else 1)

    def cell(label, column):
        row = rows[label]
        if column == "episodes":
            return f"{int(row['episode']):,}"
        if column in ("objective/kl", "pairs/kl"):
            return kl(row[column])
        name = {"eval/scores (proxy)": "eval/scores", "eval/gold_scores": "eval/gold_scores"}.get(column, column)
        if column.startswith("answer length"):
            name = "eval/response_length"
        return number(row[name], 3 if name == "eval/gold_scores" else 2)
    return cell


def rloo_vllm_run():
    """rloo_vllm.md's run: its evaluations in script_docs_runs.txt (64 episodes an update)."""
    part = read("script_docs_runs.txt").split("## python rloo_vllm.py --learning-rate 1e-4 ")[1].split("per update")[0]
    rows = {update: values.split(", ") for update, values in re.findall(r"^ {4}(\d+): (.*)$", part, re.M)}

    def cell(label, column):
        proxy, gold, kl = rows[label]
        return {"episodes": f"{64 * int(label):,}", "eval/scores (proxy)": rounded(proxy, 3),
                "eval/gold_scores": rounded(gold, 3), "objective/kl": "0" if kl == "0" else rounded(kl, 2)}[column]
    return cell


def online_dpo_vllm_speedup():
    """online_dpo_vllm.md's speed-up table: its part of async_speedup_tiny.txt."""
    output = speedup_parts("async_speedup_tiny.txt")["`online_dpo_vllm.py`"]
    modes = {"`--sync`": output["sync"], "async, K = 1": output["async"]}
    columns = {
        "training loop": lambda mode: f"{rounded(mode['loop seconds'], 1)} s",
        "episodes/s": lambda mode: rounded(mode["episodes/s"], 0),
        "learner idle": lambda mode: f"{rounded(Fraction(mode['learner idle']) * 100, 1)} %",
        "off-policy steps": lambda mode: {"0.000": "0", "0.995": "1 (0 for the first batch)"}[mode["off-policy steps"]],
        "proxy score (start -> end)": lambda mode: f"{rounded(mode['start proxy'], 2)} -> {rounded(mode['proxy score'], 2)}",
        "gold score (start -> end)": lambda mode: f"{mode['start gold']} -> {mode['gold score']}",
    }
    return lambda label, column: columns[column](modes[label])


def tba_beta():
    """tba.md's table by --beta: its runs in tba_beta_tiny.txt (update: proxy, gold, KL, as printed)."""
    runs = {}
    for beta, points in re.findall(r"^beta ([\d.]+), N 6400, E 50, P 256: (.*)$", read("tba_beta_tiny.txt"), re.M):
        runs[beta] = [point.split(": ")[1].split(", ") for point in points.split("; ")]
    columns = {
        "proxy, updates 0 -> 50 -> 100": lambda run: " -> ".join(point[0] for point in run),
        "gold": lambda run: " -> ".join(point[1] for point in run),
        "`objective/kl` at 100": lambda run: run[-1][2],
    }
    return lambda label, column: columns[column](runs[label.split()[0]])


def grpo_loss_types():
    """grpo.md's table by loss type and steps a batch: grpo_loss_types_tiny.txt (update: proxy, gold, KL; clipped)."""
    runs = {}
    for loss, steps, points, clipped in re.findall(r"^--loss-type (\w+), mini-batches (\d): (.*?); clipped ([\d.]+);",
                                                    read("grpo_loss_types_tiny.txt"), re.M):
        runs[f"`{loss}`, {steps}"] = [point.split(": ")[1].split(", ") for point in points.split("; ")], clipped
    columns = {
        "proxy, updates 0 -> 50 -> 100": lambda run, clipped: " -> ".join(rounded(p[0], 2) for p in run),
        "gold": lambda run, clipped: " -> ".join(rounded(p[1], 2) for p in run),
        "`objective/kl` at 100": lambda run, clipped: rounded(run[-1][2], 1),
        "tokens clipped": lambda run, clipped: f"{rounded(Fraction(clipped) * 100, 1)} %",
    }
    return lambda label, column: columns[column](*runs[label])


def real_models_scripts():
    """real_models.md's table: each script's SmolLM2 runs, mean (seed 1, seed 2) of the final accuracies."""
    files = {"`online_dpo_vllm.py`": "online_dpo", "`bok_vllm.py` (best of 4)": "bok", "`grpo_vllm.py`": "grpo",
             "`ppo_vllm.py` (its value model's new head starting at zeros)": "ppo", "`tba_vllm.py`": "tba"}

    def cell(label, column):
        name = "dapo" if "as DAPO" in label else files[label]
        seeds = speedup_output(read(f"async_speedup_smollm2_{name}_lr1e-5.txt"))[{"`--sync`": "sync", "async": "async"}[
            column]]["seeds"]
        finals = [exact(seed, 96) for seed in seeds]
        return f"{rounded(sum(finals) / len(finals), 2)} ({', '.join(rounded(final, 2) for final in finals)})"
    return cell


DEFINITIONS = "definitions, not measurements"
SCRIPT_DOCS = {
    "rloo.md": ({("update", "episodes"): lambda: script_default_run("rloo.py")}, {("metric", "meaning"): DEFINITIONS}),
    "bok.md": ({("update", "episodes"): lambda: script_default_run("bok.py")}, {("metric", "meaning"): DEFINITIONS}),
    "online_dpo.md": ({("update", "episodes"): lambda: script_default_run("online_dpo.py")},
                      {("metric", "meaning"): DEFINITIONS}),
    "ppo.md": ({("update", "episodes"): lambda: script_default_run("ppo.py")}, {("metric", "meaning"): DEFINITIONS}),
    "online_dpo_vllm.md": ({("update", "episodes"): lambda: script_default_run("online_dpo_vllm.py"),
                           ("mode", "training loop"): online_dpo_vllm_speedup},
                          {("argument", "meaning"): DEFINITIONS, ("metric", "meaning"): DEFINITIONS,
                           ("where vLLM runs", "backend"): "which hand-off runs where: a description"}),
    "rloo_vllm.md": ({("update", "episodes"): rloo_vllm_run}, {}),
    "tba.md": ({("`--beta`", "proxy, updates 0 -> 50 -> 100"): tba_beta}, {("metric", "meaning"): DEFINITIONS}),
    "grpo.md": ({("`--loss-type`, steps a batch", "proxy, updates 0 -> 50 -> 100"): grpo_loss_types},
                {("`--loss-type`", "`--beta`"): "loss_defaults(): a description", ("metric", "meaning"): DEFINITIONS}),
    "real_models.md": ({("script", "`--sync`"): real_models_scripts}, {}),
    "gpus.md": ({}, {("stage", "GPUs"): "benchmark/gpu_smoke.sh's stages: a description"}),
    "layout.md": ({}, {("module", "what it holds"): "the modules: a description"}),
    "off_policy_correction.md": ({}, {
        ("`--is-level`", "weight"): DEFINITIONS, ("metric", "meaning"): DEFINITIONS,
        ("response length", "`sequence`: effective sample size, mean weight"):
            "a simulation, not a stored output: tests/test_off_policy_correction.py asserts its bounds"}),
}

LORA_CHECKED = {
    ("model", "parameters"): lora_sizes,
    ("SmolLM2-135M, float32, 2 CPU cores", "full fine-tuning"): lora_cost,
    ("`grpo_vllm.py --lora-rank 16`, lr 1e-4, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_grpo_lora.txt"),
    ("`grpo_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_grpo_lr1e-5.txt"),
    ("`rloo_vllm.py --lora-rank 16`, lr 1e-4, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_rloo_lora.txt"),
    ("`rloo_vllm.py`, lr 1e-5, 10 updates", "final accuracy, seed 1, seed 2"):
        lambda: smollm2_run("async_speedup_smollm2_rloo_lr1e-5.txt"),
}
DOCS = {"results.md": (CHECKED, UNCHECKED), "performance.md": (PERFORMANCE_CHECKED, {}), "math.md": (MATH_CHECKED, {}),
        "lora.md": (LORA_CHECKED, {}), **SCRIPT_DOCS}


# A doc with a table that is not yet under this test, and why.
NOT_YET = {}


def test_every_doc_with_a_table_is_checked_here_or_says_why_not():
    with_tables = sorted(doc for doc in os.listdir(os.path.join(ROOT, "docs")) if doc.endswith(".md") and doc_tables(doc))
    assert [doc for doc in with_tables if doc not in DOCS and doc not in NOT_YET] == []


@pytest.mark.parametrize("doc", list(DOCS))
def test_every_table_of_a_doc_is_checked_or_listed_with_a_reason(doc):
    checked, unchecked = DOCS[doc]
    keys = [tuple(header[:2]) for header, _ in doc_tables(doc)]
    assert [key for key in keys if key not in checked and key not in unchecked] == []
    # A renamed header would otherwise leave its table unchecked without a failure.
    assert [key for key in [*checked, *unchecked] if key not in keys] == []


@pytest.mark.parametrize("doc, key", [(doc, key) for doc, (checked, _) in DOCS.items() for key in checked],
                         ids=[f"{doc}: {key[0] or key[1]}" for doc, (checked, _) in DOCS.items() for key in checked])
def test_table_cells_equal_their_stored_outputs(doc, key):
    cell = DOCS[doc][0][key]()
    mismatches, checked = [], 0
    for header, rows in doc_tables(doc):
        if tuple(header[:2]) != key:
            continue
        for label, row in rows.items():
            assert len(row) == len(header), f"row {label!r}: {len(row)} cells under {len(header)} columns"
            for column, value in zip(header[1:], row[1:]):
                try:
                    stored = cell(label, column)
                except KeyError as unknown:  # a row or column this test does not map to its output
                    stored = f"nothing: the test knows no row or column {unknown}"
                checked += 1
                if value.replace("**", "") != stored:  # bold is the doc's emphasis, not the figure
                    mismatches.append(f"row {label!r}, column {column!r}: the doc has {value!r}, the output {stored!r}")
    assert checked, f"no table of the doc has the header {key}"
    assert not mismatches, "\n".join(mismatches)
