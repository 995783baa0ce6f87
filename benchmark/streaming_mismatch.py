"""The mismatch KL per token of streaming responses that hold one policy version against those that hold two.

A run of rloo_vllm.py trains two updates and saves each version (checkpoint-1, checkpoint-2). The streaming generator
(generator.StreamingThread, the scripts' own) then starts from version 1 on --groups prompts of the train split (k
responses each), runs --steps decoding steps, loads version 2 while those requests are in flight, starts as many
prompts again, and runs every request to its end. Responses that ended before the load hold version 1 alone, those
in flight at it versions 1 and 2, those started after it version 2 alone. Against the learner's policy after update 2
(version 2: the proximal policy of the update that trains on them with K = 1), each token's k3 KL of the behaviour
log-probability vLLM reported (the scripts' async/mismatch_kl) is averaged per token over each kind of response.
The same again with the keys and values of the requests in flight kept at the load, not computed again (what the
generator does not do): the tokens a mixed response samples after it then belong to neither version.

    python benchmark/streaming_mismatch.py --task math | tee benchmark/results/streaming_mismatch_math.txt
    python benchmark/streaming_mismatch.py --task smollm2 | tee benchmark/results/streaming_mismatch_smollm2.txt
"""

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import generator  # noqa: E402
import rloo_vllm  # noqa: E402
import vllm_engine  # noqa: E402
import weight_handoff  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASKS = {  # the run that makes versions 1 and 2, and the generation's response length
    "math": (["--sft-model-path", "assets/tiny_math/sft", "--dataset-name", "assets/tiny_math/data", "--rule-reward",
              "last_number", "--max-prompt-length", "48", "--learning-rate", "3e-4"], 8),
    "smollm2": (["--sft-model-path", "assets/smollm2/model", "--dataset-name", "assets/smollm2/data", "--rule-reward",
                 "last_number", "--max-prompt-length", "64", "--k", "4", "--per-device-train-batch-size", "32",
                 "--learning-rate", "1e-5", "--missing-eos-penalty", "0"], 64),
}


def k3(proximal, behaviour):
    """The scripts' mismatch_kl per token: r - 1 - log r, r = pi_prox / pi_behaviour."""
    log_r = (proximal - behaviour).clamp(max=20)
    return torch.exp(log_r) - 1 - log_r


def stream(args, llm, prompts, versions, steps, recompute):
    """Groups of k responses from version 1, version 2 loaded after `steps` decoding steps (the requests in flight kept,
    their keys and values computed again unless not `recompute`), as many groups again after it: every finished
    response as (prompt, tokens, behaviour log-probabilities, token versions)."""
    thread = generator.StreamingThread(args, llm, rloo_vllm.sampling_params, rloo_vllm.generating_version,
                                       rloo_vllm.batch_prompts, weights_dir=tempfile.mkdtemp(), train_prompts=prompts,
                                       prompts_per_rank=len(prompts), k=args.k, stop_id=args.stop_id, first_version=1,
                                       off_policy_steps=1, probe=None, in_memory=False)
    engine = llm.llm_engine
    engine.set_weight_version("1")
    reset = engine.reset_prefix_cache
    if not recompute:
        engine.reset_prefix_cache = lambda *args, reset_running_requests=False, **kwargs: (
            True if reset_running_requests else reset(*args, **kwargs))  # the running requests' keys and values kept
    try:
        for _ in range(len(prompts) // 2):
            thread._submit()
        for _ in range(steps):
            thread._step(1)
        thread._load(2, shutil.copytree(versions[2], versions[2] + "-loaded"), None, None)  # (it deletes what it loads)
        for _ in range(len(prompts) // 2):
            thread._submit()
        while thread.running:
            thread._step(2)
    finally:
        engine.reset_prefix_cache = reset
    return [(prompts[thread.untrained[group]], *sample) for group in thread.done for sample in thread.samples[group]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="math")
    parser.add_argument("--groups", type=int, default=32, help="prompts (k responses each), half before the load")
    parser.add_argument("--steps", type=int, default=3, help="decoding steps of version 1 before version 2 loads")
    options = parser.parse_args()
    if options.task == "smollm2":
        from smollm2_sync_mismatch import build_smollm2
        build_smollm2()
    run, response_length = TASKS[options.task]
    with tempfile.TemporaryDirectory() as tmp:
        args = rloo_vllm.Args(sft_model_path=run[1], dataset_name=run[3], rule_reward="last_number",
                              max_prompt_length=int(run[run.index("--max-prompt-length") + 1]),
                              response_length=response_length, temperature=1.0, bf16=False, vllm_enforce_eager=True,
                              seed=1, k=4)
        per_batch = int(run[run.index("--per-device-train-batch-size") + 1]) if "--per-device-train-batch-size" in run \
            else args.per_device_train_batch_size  # (one process: a batch, two updates)
        subprocess.run([sys.executable, "rloo_vllm.py", *run, "--total-episodes", str(2 * per_batch), "--save-every",
                        "1", "--eval-every", "0", "--num-eval-prompts", "16", "--output-dir", tmp,
                        "--vllm-enforce-eager"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        (run_dir,) = glob.glob(os.path.join(tmp, "*__*"))
        models, versions = {}, {}
        for version in (1, 2):
            models[version] = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, f"checkpoint-{version}"),
                                                                   dtype=torch.float32).eval()
            versions[version] = os.path.join(tmp, f"policy-{version}")
            weight_handoff.write_for_vllm(models[version], models[version].state_dict(), versions[version])
            AutoTokenizer.from_pretrained(run[1]).save_pretrained(versions[version])  # (vLLM starts from version 1)
        os.chdir(ROOT)
        args.world_size, args.batch_size = 1, options.groups * args.k
        tokenizer = data.load_tokenizer(args.sft_model_path, False)
        args.stop_id = data.stop_token_id(args, tokenizer)
        prompts = data.load_prompts(args, tokenizer)[0][:options.groups]
        print(f"# {' '.join(sys.argv)}: {options.groups} prompts x {args.k} responses of at most {response_length} "
              f"tokens, temperature 1, float32; version 2 loaded after {options.steps} decoding steps; the versions: "
              f"checkpoint-1 and checkpoint-2 of `rloo_vllm.py {' '.join(run)}` (seed 1)")
        for recompute in (True, False):
            llm = vllm_engine.start_vllm(args, versions[1])
            try:
                responses = stream(args, llm, prompts, versions, options.steps, recompute)
            finally:
                vllm_engine.shut_down(llm)
            kinds = {"version 1 alone": [], "versions 1 and 2": [], "version 2 alone": []}
            by_token = {1: [], 2: []}  # the mixed responses' tokens, by their version
            for prompt, tokens, logprobs, token_versions in responses:
                ids = torch.tensor([prompt + tokens])
                with torch.no_grad():
                    logits = models[2](ids).logits[0, len(prompt) - 1: -1].double()
                proximal = torch.log_softmax(logits, -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
                values = k3(proximal, torch.tensor(logprobs, dtype=torch.float64))
                held = sorted(set(token_versions))
                kinds[{(1,): "version 1 alone", (1, 2): "versions 1 and 2", (2,): "version 2 alone"}[tuple(held)]]\
                    .append(values)
                if len(held) == 2:
                    for v in (1, 2):
                        by_token[v].append(values[torch.tensor(token_versions) == v])
            print(f"\nkeys and values of the requests in flight {'computed again' if recompute else 'KEPT'} at the "
                  f"load; mismatch KL per token against version 2 (k3, the scripts' async/mismatch_kl):")
            for kind, values in kinds.items():
                tokens = torch.cat(values) if values else torch.zeros(0)
                print(f"  responses of {kind:17}: {len(values):4} responses, {tokens.numel():5} tokens, "
                      f"mismatch KL {tokens.mean().item() if tokens.numel() else float('nan'):.3e}")
            for v, values in by_token.items():
                tokens = torch.cat(values) if values else torch.zeros(0)
                print(f"    their tokens of version {v}: {tokens.numel():5} tokens, mismatch KL "
                      f"{tokens.mean().item() if tokens.numel() else float('nan'):.3e}")


if __name__ == "__main__":
    main()
