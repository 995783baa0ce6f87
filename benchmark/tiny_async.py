"""The paper's Figure 4 with real asynchrony: win rate against K, the policy versions between the one
that generates a batch and the one that trains on it, on the tiny task, on a CPU.

Each *_vllm.py script trains with `--off-policy-steps K`, K in {1, 2, 4, 8}, and with `--sync` (K = 0):
vLLM generates batch t with the policy of K updates before the learner's. Every run takes the same
optimizer steps on the same episodes. RLOO, PPO and GRPO run without the off-policy correction (`--is-cap 0`,
as the paper's code) and again with it (`--is-cap 2`, "+IS"), and GRPO as DAPO with it; each run's smallest
effective sample size of the weights and largest truncated share go into the CSV. Each final policy is evaluated with
evaluate.py (gold win rate against the references, KL to the SFT model); results go to a CSV and a plot
of win rate against K and against KL, beside benchmark/tiny_offpolicy.py's N-mini-batch experiment.

    python benchmark/tiny_async.py                             # 9 variants x 5 K x 2 seeds, 2 runs at a time: 66 min
    python benchmark/tiny_async.py --seeds 2 --add-to-csv      # one more seed, kept beside the CSV's others
    python benchmark/tiny_async.py --variants grpo grpo+IS dapo+IS --add-to-csv   # GRPO beside the others
    python benchmark/tiny_async.py --variants online_dpo rloo+IS --k 0 8
    python benchmark/tiny_async.py --variants tba --k 0 2 8 --add-to-csv     # TBA beside the others

Results go to benchmark/results/ (tiny_async.csv; the figure tiny_async.png, drawn by benchmark/plot.py from the CSV,
its command and points in tiny_async_plot.txt) unless --out says otherwise.
"""

import argparse
import concurrent.futures
import csv
import json
import os
import tempfile
import time

from tiny_offpolicy import ROOT, plot, train_and_evaluate_command

# variant: (script, its own arguments)
VARIANTS = {
    "online_dpo": ("online_dpo_vllm.py", []),
    "ppo": ("ppo_vllm.py", ["--is-cap", "0"]),
    "rloo": ("rloo_vllm.py", ["--is-cap", "0"]),
    "bok": ("bok_vllm.py", []),
    "ppo+IS": ("ppo_vllm.py", ["--is-cap", "2"]),
    "rloo+IS": ("rloo_vllm.py", ["--is-cap", "2"]),
    "grpo": ("grpo_vllm.py", ["--is-cap", "0"]),
    "grpo+IS": ("grpo_vllm.py", ["--is-cap", "2"]),
    # As stored in tiny_async.csv (session 34): DAPO's clip and token mean with GRPO's KL weight, before each loss
    # type ran its paper's defaults (a bare --loss-type dapo now adds beta 0 and overlong shaping).
    "dapo+IS": ("grpo_vllm.py", ["--is-cap", "2", "--loss-type", "dapo", "--beta", "0.04", "--overlong-buffer", "0"]),
    "tba": ("tba_vllm.py", []),  # trajectory balance needs no correction: the buffer's older responses are its input
}

K_LABEL = "K (policy versions between generation and training; 0 is --sync)"

def read_rows(path):
    """The rows of a CSV this benchmark wrote, with their types back (to add seeds or variants to it)."""
    with open(path) as f:
        return [{key: value if key == "algorithm" or value == "" else int(value) if key in ("k", "seed") else float(value)
                 for key, value in row.items()} for row in csv.DictReader(f)]


def write_rows(path, rows):
    """The rows as a CSV: every column any row has, empty where a row has none (older rows: no min_is_ess)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(dict.fromkeys(key for row in rows for key in row)), restval="")
        writer.writeheader()
        writer.writerows(rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--k", nargs="+", type=int, default=[0, 1, 2, 4, 8], help="off-policy steps (0: --sync)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2], help="seeds of every setting")
    parser.add_argument("--add-to-csv", action="store_true",
                        help="keep the CSV's other rows (to add seeds or variants to an earlier invocation's results)")
    parser.add_argument("--total-episodes", type=int, default=4096,
                        help="episodes per run: 64 optimizer steps of 64 responses, as tiny_offpolicy.py")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--num-eval-prompts", type=int, default=512)
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (2 keeps both cores busy between runs' loops)")
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results"))
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)

    csv_path = os.path.join(options.out, "tiny_async.csv")
    rows, started = [], time.time()
    if options.add_to_csv:
        rows = [row for row in read_rows(csv_path)
                if row["seed"] not in options.seeds or row["algorithm"] not in options.variants]
    settings = [(seed, variant, k) for seed in options.seeds for variant in options.variants for k in options.k
                if not (k == 0 and variant.endswith("+IS"))]  # K = 0 is on-policy, the weights are 1: the run without IS

    def run(setting, tmp):
        seed, variant, k = setting
        script, arguments = VARIANTS[variant]
        mode = ["--sync"] if k == 0 else ["--off-policy-steps", str(k)]
        t0 = time.time()
        out = os.path.join(tmp, f"{variant}_{k}_{seed}")
        result = train_and_evaluate_command([script, *arguments, *mode, "--vllm-enforce-eager"], seed, options, out)
        (run_name,) = os.listdir(out)
        with open(os.path.join(out, run_name, "metrics.jsonl")) as f:
            trained = [row for row in map(json.loads, f) if "async/is_ess" in row]
        correction = {"min_is_ess": min(row["async/is_ess"] for row in trained) if trained else "",
                      "max_is_truncated": max(row["async/is_truncated"] for row in trained) if trained else ""}
        return {"algorithm": variant, "k": k, "seed": seed, **result, **correction, "seconds": round(time.time() - t0, 1)}

    # Runs can overlap (--jobs 2): one starts up or evaluates while another trains. Results do not change, since
    # the schedule, not timing, decides which policy version generates each batch.
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(options.jobs) as pool:
        for row in pool.map(run, settings, [tmp] * len(settings)):
            rows.append(row)
            print(f"{row['algorithm']:>11} K={row['k']:<2} seed {row['seed']}: win rate {row['win_rate']:.3f}, gold "
                  f"{row['gold_score']:.3f}, KL {row['kl']:.2f} ({row['seconds']:.0f} s)", flush=True)
    rows.sort(key=lambda row: (row["seed"], list(VARIANTS).index(row["algorithm"]), row["k"]))
    write_rows(csv_path, rows)
    plot(csv_path, knob="k", knob_label=K_LABEL)

    seeds = sorted({row["seed"] for row in rows})
    print(f"\nmean gold win rate (KL) over seeds {seeds}, {time.time() - started:.0f} s in all")
    print(f"{'':>11}" + "".join(f"{'K=' + str(k):>16}" for k in options.k))
    for variant in options.variants:
        cells = []
        for k in options.k:
            mine = [r for r in rows if r["algorithm"] == variant and r["k"] == k]
            cells.append(f"{sum(r['win_rate'] for r in mine) / len(mine):.3f} ({sum(r['kl'] for r in mine) / len(mine):.1f})"
                         if mine else "")
        print(f"{variant:>11}" + "".join(f"{c:>16}" for c in cells))
    print(f"wrote {options.out}/tiny_async.csv, tiny_async.png and tiny_async_plot.txt")


if __name__ == "__main__":
    main()
