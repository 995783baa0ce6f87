"""The paper's off-policy robustness experiment (its Figure 4) in miniature, on the tiny task, on a CPU.

Each algorithm trains with N mini-batches per generation batch, N in {1, 2, 4, 8, 16}: one
generation round feeds N optimizer steps, so the n-th step learns from samples of a policy n-1
steps old. Every run takes the same number of optimizer steps on the same number of episodes
(the generation batch grows with N). Each run's final policy is evaluated with evaluate.py
(gold win rate against the references, KL to the SFT model), and the results go to a CSV and a
plot of win rate against N and against KL.

    python benchmark/tiny_offpolicy.py                         # 4 algorithms x 5 N x 2 seeds, about 30 min on 2 cores
    python benchmark/tiny_offpolicy.py --seeds 1 --algorithms online_dpo ppo --n 1 16

Results go to benchmark/results/ (tiny_offpolicy.csv; the figure tiny_offpolicy.png, drawn by benchmark/plot.py from
the CSV, its command and points in tiny_offpolicy_plot.txt) unless --out says otherwise.
"""

import argparse
import csv
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ALGORITHMS = ["online_dpo", "ppo", "rloo", "bok"]


def train_and_evaluate(algorithm, n, seed, options, tmp):
    out = os.path.join(tmp, f"{algorithm}_{n}_{seed}")
    started = time.time()
    row = {"algorithm": algorithm, "n": n, "seed": seed}
    return {**row, **train_and_evaluate_command([f"{algorithm}.py", "--num-mini-batches", str(n)], seed, options, out),
            "seconds": round(time.time() - started, 1)}


def train_and_evaluate_command(command, seed, options, out):
    """Train with `command` (a script and its own arguments) at the benchmark's settings, then evaluate the final
    policy with evaluate.py: its win rate, gold score, KL, perplexity and response length."""
    subprocess.run([sys.executable, *command, "--seed", str(seed), "--learning-rate", str(options.learning_rate),
                    "--total-episodes", str(options.total_episodes), "--eval-every", "0", "--output-dir", out],
                   cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    (run_name,) = os.listdir(out)
    subprocess.run([sys.executable, "evaluate.py", "--checkpoints", os.path.join(out, run_name), "--backend", "hf",
                    "--num-eval-prompts", str(options.num_eval_prompts), "--seed", str(seed)], cwd=ROOT, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    with open(os.path.join(out, run_name, "evaluation.json")) as f:
        (metrics,) = json.load(f)["checkpoints"].values()
    return {k: metrics[k] for k in ("win_rate", "gold_score", "kl", "perplexity", "response_length")}


def plot(csv_path, knob="n", knob_label="N (mini-batches per generation batch; more is more off-policy)"):
    """The figure beside the CSV (<name>.png): each algorithm's gold win rate against the off-policy knob and against
    KL, the mean over seeds with their range, drawn by benchmark/plot.py, whose command and points go to
    <name>_plot.txt."""
    base = os.path.splitext(csv_path)[0]
    command = [os.path.relpath(csv_path, ROOT), "--by", "algorithm", "--x", knob, "kl", "--metric", "win_rate",
               "--symlog-x", "--xlabel", knob_label, "KL to the SFT model (nats, on the policy samples)",
               "--ylabel", "gold win rate vs references", "--out", os.path.relpath(base + ".png", ROOT)]
    with open(base + "_plot.txt", "w") as f:
        subprocess.run([sys.executable, "benchmark/plot.py", *command], cwd=ROOT, stdout=f, check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=ALGORITHMS, choices=ALGORITHMS)
    parser.add_argument("--n", nargs="+", type=int, default=[1, 2, 4, 8, 16], help="mini-batches per generation batch")
    parser.add_argument("--seeds", type=int, default=2, help="seeds per setting (1, 2, ...)")
    parser.add_argument("--total-episodes", type=int, default=4096,
                        help="episodes per run: 64 optimizer steps of 64 responses (4 generation rounds at N = 16), "
                             "short enough that the on-policy runs have not saturated")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--num-eval-prompts", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results"))
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)

    rows, started = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(1, options.seeds + 1):
            for algorithm in options.algorithms:
                for n in options.n:
                    rows.append(train_and_evaluate(algorithm, n, seed, options, tmp))
                    row = rows[-1]
                    print(f"{algorithm:>11} N={n:<3} seed {seed}: win rate {row['win_rate']:.3f}, gold "
                          f"{row['gold_score']:.3f}, KL {row['kl']:.2f} ({row['seconds']:.0f} s)", flush=True)
    with open(os.path.join(options.out, "tiny_offpolicy.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(os.path.join(options.out, "tiny_offpolicy.csv"))

    print(f"\nmean gold win rate (KL) over {options.seeds} seed(s), {time.time() - started:.0f} s in all")
    print(f"{'':>11}" + "".join(f"{'N=' + str(n):>16}" for n in options.n))
    for algorithm in options.algorithms:
        cells = []
        for n in options.n:
            mine = [r for r in rows if r["algorithm"] == algorithm and r["n"] == n]
            cells.append(f"{sum(r['win_rate'] for r in mine) / len(mine):.3f} ({sum(r['kl'] for r in mine) / len(mine):.1f})")
        print(f"{algorithm:>11}" + "".join(f"{c:>16}" for c in cells))
    print(f"wrote {options.out}/tiny_offpolicy.csv, tiny_offpolicy.png and tiny_offpolicy_plot.txt")


if __name__ == "__main__":
    main()
