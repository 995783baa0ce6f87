"""The cost of one weight hand-off from the learner to vLLM, in memory against through files, by model size.

For GPT-NeoX models built from config (random weights) at about 3 M, 160 M (Pythia-160M's shape) and 1 B
(Pythia-1B's) parameters, in float32 and bfloat16, starts a vLLM engine as online_dpo_vllm.py does (one CPU core
here) and times each way of handing it a new version of the weights, the median of `--repeats`:

- file (`--weight-sync file`): the learner writes a save_pretrained directory to /dev/shm (learner side), vLLM
  reloads it and empties its prefix cache (generator side); the total is both, one after the other.
- memory (`--weight-sync memory`, the default on GPUs): vLLM's weight transfer; on a CPU, vLLM's NCCL engines over
  gloo, from the tests' vLLM plugin (tests/cpu_weight_transfer, put on PYTHONPATH here). The learner starts the update and broadcasts
  the tensors while vLLM's worker receives and loads them (learner side: until the last bytes have gone); the
  generator then waits for the worker to finish loading and finishes the update (finish_weight_update, the prefix
  cache emptied). vLLM is busy from the start to the end: generator side = total.

It prints one row per model and precision: the seconds, the in-memory path's speed-up, and how far vLLM's
next-token log-probabilities are from the learner's after each kind of hand-off (the largest gap over 5 tokens
and the repeats: ~1e-5 in float32; bfloat16's rounding shows). Each engine takes 20-60 s to start; the
whole run takes about 10 minutes on 2 CPU cores and 18 GB of memory.

    python benchmark/weight_sync.py
    python benchmark/weight_sync.py --sizes 3M 160M --repeats 5
"""

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
PLUGIN = os.path.join(ROOT, "tests", "cpu_weight_transfer")  # vLLM loads it in this process and in its engine's
sys.path.insert(0, PLUGIN)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [PLUGIN, os.environ.get("PYTHONPATH")]))

import torch  # noqa: E402
from transformers import AutoTokenizer, GPTNeoXConfig, GPTNeoXForCausalLM  # noqa: E402

import online_dpo_vllm as script  # noqa: E402
import vllm_engine  # noqa: E402
import weight_handoff  # noqa: E402

TOKENIZER = os.path.join(ROOT, "assets", "tiny", "sft")
# (hidden size, layers, attention heads, vocabulary): the tiny task's vocabulary at 3 M, Pythia's shapes above.
SIZES = {"3M": (256, 4, 4, 638), "160M": (768, 12, 12, 50304), "1B": (2048, 16, 8, 50304)}


def build(size, dtype):
    hidden, layers, heads, vocab = SIZES[size]
    config = GPTNeoXConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                           intermediate_size=4 * hidden, max_position_embeddings=2048, rotary_pct=0.25,
                           use_parallel_residual=True, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPTNeoXForCausalLM(config).to(dtype).eval()


def perturb(model, step):
    """A new version of the weights, as an update makes one (every parameter changes a little)."""
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(torch.full_like(p, 1e-2 * ((step + i) % 3 - 1)))


def vllm_gap(llm, model):
    """How far vLLM's weights are from the learner's: the largest difference between vLLM's log-probabilities of
    its 5 likeliest next tokens (after a 32-token prompt) and the learner's."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompt = list(range(1, 33))
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0].outputs[0]
    with torch.no_grad():
        learner = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1].float(), -1)
    return max(abs(learner[token].item() - logprob.logprob) for token, logprob in out.logprobs[0].items())


def measure(size, bf16, repeats, tokenizer):
    dtype = torch.bfloat16 if bf16 else torch.float32
    model = build(size, dtype)
    parameters = sum(p.numel() for p in model.parameters())
    work = tempfile.mkdtemp(dir="/dev/shm")
    try:
        model.save_pretrained(os.path.join(work, "v0"))
        tokenizer.save_pretrained(os.path.join(work, "v0"))
        args = script.Args(bf16=bf16, vllm_enforce_eager=True, max_prompt_length=32, response_length=8)
        args.batch_size, args.world_size = 2, 1
        started = time.perf_counter()
        llm = vllm_engine.start_vllm(args, os.path.join(work, "v0"), weight_transfer=True)
        start_seconds = time.perf_counter() - started
        shutil.rmtree(os.path.join(work, "v0"))  # as the scripts do: at 1 B in float32 memory is short
        try:
            transfer = weight_handoff.weight_transfer(args, llm, model, rank=0)
            file_learner, file_generator, memory_learner, memory_total, file_gap, memory_gap = [], [], [], [], [], []
            # All file hand-offs first: the directory in /dev/shm and vLLM's kept receive buffers (a copy of the
            # model each) are never in memory together, which 1 B parameters in float32 need on 24 GB.
            for step in range(repeats):
                perturb(model, step)
                path = os.path.join(work, f"v{step + 1}")
                t0 = time.perf_counter()
                model.save_pretrained(path)
                t1 = time.perf_counter()
                vllm_engine.load_into_vllm(llm, path)
                t2 = time.perf_counter()
                shutil.rmtree(path)
                file_learner.append(t1 - t0)
                file_generator.append(t2 - t1)
                file_gap.append(vllm_gap(llm, model))
            for step in range(repeats):
                perturb(model, repeats + step)
                t0 = time.perf_counter()
                transfer.send_weights()
                t1 = time.perf_counter()
                getattr(transfer, "finish", lambda: None)()  # the CPU plugin's engine leaves vLLM's load to it
                memory_learner.append(t1 - t0)
                memory_total.append(time.perf_counter() - t0)
                memory_gap.append(vllm_gap(llm, model))
        finally:
            vllm_engine.shut_down(llm)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    median = statistics.median
    return {"parameters": parameters, "engine start": start_seconds, "file learner": median(file_learner),
            "file generator": median(file_generator), "file total": median(file_learner) + median(file_generator),
            "memory learner": median(memory_learner), "memory total": median(memory_total),
            "file gap": max(file_gap), "memory gap": max(memory_gap)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--repeats", type=int, default=3, help="hand-offs of each kind per model (median)")
    options = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) - 1))  # as in the scripts: vLLM has a core of its own
    columns = ["file learner", "file generator", "file total", "memory learner", "memory total"]
    print(f"{'model':>6} {'dtype':>5} {'params':>8} " + " ".join(f"{c:>15}" for c in columns) +
          "  speed-up: learner, total   logprob gap: file, memory")
    for size in options.sizes:
        for precision in options.precisions:
            row = measure(size, precision == "bf16", options.repeats, tokenizer)
            print(f"{size:>6} {precision:>5} {row['parameters'] / 1e6:7.1f}M " +
                  " ".join(f"{row[c]:14.3f}s" for c in columns) +
                  f"  {row['file learner'] / row['memory learner']:8.1f}x {row['file total'] / row['memory total']:6.1f}x"
                  f"   {row['file gap']:.0e}, {row['memory gap']:.0e}", flush=True)


if __name__ == "__main__":
    main()
