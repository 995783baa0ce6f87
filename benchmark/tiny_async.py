"""The paper's Figure 4 with real asynchrony: win rate against K, the policy versions between the one
that generates a batch and the one that trains on it, on the tiny task, on a CPU.

Each *_vllm.py script trains with `--off-policy-steps K`, K in {1, 2, 4, 8}, and with `--sync` (K = 0):
vLLM generates batch t with the policy of K updates before the learner's. Every run takes the same
optimizer steps on the same episodes. RLOO and PPO run without the off-policy correction (`--is-cap 0`,
as the paper's code) and again with it (`--is-cap 2`, "+IS"). Each final policy is evaluated with
evaluate.py (gold win rate against the references, KL to the SFT model); results go to a CSV and a plot
of win rate against K and against KL, beside benchmark/tiny_offpolicy.py's N-mini-batch experiment.

    python benchmark/tiny_async.py                             # 6 variants x 5 K x 1 seed, about 40 min on 2 cores
    python benchmark/tiny_async.py --seeds 2                   # the issue's 2 seeds: about 80 min
    python benchmark/tiny_async.py --variants online_dpo rloo+IS --k 0 8

Results go to benchmark/results/ (tiny_async.csv, tiny_async.png) unless --out says otherwise.
"""

import argparse
import csv
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
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--k", nargs="+", type=int, default=[0, 1, 2, 4, 8], help="off-policy steps (0: --sync)")
    parser.add_argument("--seeds", type=int, default=1, help="seeds per setting (1, 2, ...)")
    parser.add_argument("--total-episodes", type=int, default=4096,
                        help="episodes per run: 64 optimizer steps of 64 responses, as tiny_offpolicy.py")
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--num-eval-prompts", type=int, default=512)
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmark", "results"))
    options = parser.parse_args()
    os.makedirs(options.out, exist_ok=True)

    rows, started = [], time.time()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in range(1, options.seeds + 1):
            for variant in options.variants:
                script, arguments = VARIANTS[variant]
                for k in options.k:
                    if k == 0 and variant.endswith("+IS"):  # on-policy, the weights are 1: the run without IS
                        continue
                    mode = ["--sync"] if k == 0 else ["--off-policy-steps", str(k)]
                    t0 = time.time()
                    result = train_and_evaluate_command([script, *arguments, *mode, "--vllm-enforce-eager"], seed,
                                                        options, os.path.join(tmp, f"{variant}_{k}_{seed}"))
                    rows.append({"algorithm": variant, "k": k, "seed": seed, **result,
                                 "seconds": round(time.time() - t0, 1)})
                    print(f"{variant:>11} K={k:<2} seed {seed}: win rate {result['win_rate']:.3f}, gold "
                          f"{result['gold_score']:.3f}, KL {result['kl']:.2f} ({rows[-1]['seconds']:.0f} s)", flush=True)
    with open(os.path.join(options.out, "tiny_async.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, os.path.join(options.out, "tiny_async.png"), knob="k",
         knob_label="K (policy versions between generation and training; 0 is --sync)")

    print(f"\nmean gold win rate (KL) over {options.seeds} seed(s), {time.time() - started:.0f} s in all")
    print(f"{'':>11}" + "".join(f"{'K=' + str(k):>16}" for k in options.k))
    for variant in options.variants:
        cells = []
        for k in options.k:
            mine = [r for r in rows if r["algorithm"] == variant and r["k"] == k]
            cells.append(f"{sum(r['win_rate'] for r in mine) / len(mine):.3f} ({sum(r['kl'] for r in mine) / len(mine):.1f})"
                         if mine else "")
        print(f"{variant:>11}" + "".join(f"{c:>16}" for c in cells))
    print(f"wrote {options.out}/tiny_async.csv and tiny_async.png")


if __name__ == "__main__":
    main()
