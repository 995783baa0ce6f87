"""Memory of the policy's passes with the language-model head on every position (the scripts before issue 66: the
logits of the prompt computed, then sliced away) against the head on the response's positions alone (response_logits,
as every script computes now), computed and measured in one invocation.

Computed, from the models' configurations (typed in from Pythia's config.json: nothing is downloaded), at the paper's
TL;DR shapes (16 sequences a device, 512-token prompts, 53-token responses; Pythia's padded vocabulary of 50,304):
- the bytes of the logits a training step holds through its backward pass (the head's output and the gradient flowing
  into it, in the weights' precision) and of the float32 log-probability tensors computed from the response's logits
  (the same before and after);
- with --updates (alone): the peak memory of one update on a device, traced. transformers' GPTNeoXForCausalLM, built
  from each Pythia configuration in bf16 under torch's FakeTensorMode (no memory allocated, no arithmetic done), runs
  the training step measured below (forward, loss, backward, the entropy after it) inside torch's MemTracker, which
  sums the live tensors' bytes (rounded up to 512 as CUDA's allocator rounds) after every operation. Its peak counts
  the bf16 weights, their gradients held whole (accumulated over the micro-batches), activations and temporaries;
  added to it: AdamW's float32 master weights and two moments (12 bytes a parameter) split over tldr.sh's 4 GPUs by
  ZeRO-2, and the reference's and reward model's bf16 weights. The logits: the live tensors whose last dimension is
  the vocabulary (the head's output, its float32 copies, the log-softmax, their gradients) at that peak. The scoring
  passes (the reference's and the policy's, without gradients) run before the step and peak lower. Gradient
  checkpointing is off, as in tldr.sh but at 2.8B, which runs 4 sequences a device checkpointed: the last row.

Measured: one training step's forward and backward pass of the policy (the scripts' loss shape: the mean of the
response's log-probabilities at temperature 0.7; the logits held for the entropy after it, as the scripts hold them)
and one scoring pass without gradients, each as before and as now:
- on a GPU: Pythia-410M, 1B and 2.8B of those shapes with random weights in bf16, the peak of allocated memory above
  the weights and their gradients (torch.cuda.max_memory_allocated);
- on a CPU: SmolLM2-135M-Instruct (assets/smollm2) in float32 at its workload (32 sequences: 8 prompts of its chat
  arithmetic x 4, 16-token responses), the peak resident memory above that before the pass, each in a fresh process.

    python benchmark/logits_memory.py | tee benchmark/results/logits_memory_cpu.txt        # on this machine
    python benchmark/logits_memory.py --updates | tee benchmark/results/logits_memory_pythia.txt   # the traced peaks
    python3 benchmark/logits_memory.py | tee benchmark/results/logits_memory_h200.txt      # on a GPU
"""

import json
import os
import resource
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import rloo  # noqa: E402  (the scripts' forward, response_logits, response_logprobs)

# name: (layers, hidden, intermediate, attention heads), from each model's config.json
PYTHIA = {"Pythia-410M": (24, 1024, 4096, 16), "Pythia-1B": (16, 2048, 8192, 8), "Pythia-2.8B": (32, 2560, 10240, 32)}
VOCAB, SEQUENCES, PROMPT, RESPONSE, TEMPERATURE, GB = 50304, 16, 512, 53, 0.7, 1e9
GPUS = 4  # tldr.sh's training GPUs, over which ZeRO-2 splits the optimizer's state


def run_pass(model, query_responses, pad, context_length, now, train):
    """A pass as the scripts' training step makes it (the logits held through the backward pass, for the entropy
    computed after it) or, without `train`, as their scoring passes make it: as now (response_logits, a gather minus
    a logsumexp), or as before (the head on every position, the response's logits sliced from them, a full
    log-softmax)."""
    responses = query_responses[:, context_length:]
    with torch.set_grad_enabled(train):
        if now:
            logits = rloo.response_logits(model, query_responses, pad, context_length)
            logprobs = rloo.response_logprobs(logits, responses, TEMPERATURE)
        else:
            logits = rloo.forward(model, query_responses, pad).logits
            response = logits[:, context_length - 1: -1].float() / TEMPERATURE
            logprobs = torch.log_softmax(response, -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)
        if train:
            (-logprobs.mean()).backward()
            with torch.no_grad():
                rloo.entropy_from_logits((logits if now else logits[:, context_length - 1: -1]) / TEMPERATURE)


def computed(sequences, length, response, vocab, weight_bytes):
    """(before, now) in bytes: the head's output and its gradient (weight_bytes each), and the float32 tensors of
    the response's logits divided by the temperature and of their log-softmax (or logsumexp input), alike in both."""
    response_fp32 = 2 * sequences * response * vocab * 4
    return (2 * sequences * length * vocab * weight_bytes + response_fp32,
            2 * sequences * (response + 1) * vocab * weight_bytes + response_fp32)


def pythia_config(layers, hidden, intermediate, heads):
    from transformers import GPTNeoXConfig
    return GPTNeoXConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, intermediate_size=intermediate,
                         num_attention_heads=heads, rotary_pct=0.25, max_position_embeddings=2048,
                         tie_word_embeddings=False)


def traced_peak(config, sequences, now, train, checkpointing=False):
    """(peak bytes, the vocabulary-wide tensors' bytes at that peak) of one pass of a fake bf16 Pythia (see above)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.weak import WeakIdKeyDictionary
    from transformers import GPTNeoXForCausalLM

    class Tracker(MemTracker):  # MemTracker, also noting which live storages hold vocabulary-wide tensors at its peak
        def __init__(self):
            super().__init__()
            self.vocab_storages, self.peak_logits = WeakIdKeyDictionary(), 0

        def _track(self, reftype, t):
            super()._track(reftype, t)
            if t.dim() and t.shape[-1] == VOCAB:
                self.vocab_storages[t.untyped_storage()] = True

        def _update_peak_stats(self, peak_state):
            peak = dict(self._peak_mem)
            super()._update_peak_stats(peak_state)
            if self._peak_mem != peak:
                live = (self._WINFO[st][0] for st in self.vocab_storages if st in self._WINFO)
                self.peak_logits = sum(winfo.mem_consumed for winfo in live)

    with FakeTensorMode():
        torch.set_default_dtype(torch.bfloat16)  # built in bf16, as load_model loads it under --bf16
        model = GPTNeoXForCausalLM(config)
        torch.set_default_dtype(torch.float32)
        if checkpointing:  # as load_model does under --gradient-checkpointing
            model.gradient_checkpointing_enable()
            model.train()
        if train:
            for p in model.parameters():
                p.grad = torch.zeros_like(p)  # held through the step as the accumulated gradients are
        ids = torch.randint(0, VOCAB, (sequences, PROMPT + RESPONSE))
        tracker = Tracker()
        tracker.track_external(model, ids)
        with tracker:
            run_pass(model, ids, VOCAB, PROMPT, now, train)
        return max(tracker._peak_mem.values()), tracker.peak_logits, sum(p.numel() for p in model.parameters())


def computed_updates():
    """The peak of one update per Pythia model (see above), before and now, and the logits' share of it."""
    print(f"computed peak GB of one update on a device, TL;DR shapes ({PROMPT} + {RESPONSE} tokens, vocabulary "
          f"{VOCAB}), bf16, ZeRO-2 over {GPUS} GPUs: step = the traced training step's peak (weights, gradients, activations, "
          "logits); update = step + AdamW's state + the reference's and reward model's weights; logits: the "
          "vocabulary-wide tensors live at the step's peak, share: of the update; scoring pass: a pass without "
          "gradients (the reference's) + the same additions, no gradients held")
    print("| model | sequences | parameters | step before | logits | update before | share | step now | logits "
          "| update now | share | scoring pass: before | now |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    rows = [(name, shape, SEQUENCES, False) for name, shape in PYTHIA.items()]
    rows.append(("Pythia-2.8B, checkpointed", PYTHIA["Pythia-2.8B"], 4, True))
    for name, (layers, hidden, intermediate, heads), sequences, checkpointing in rows:
        config = pythia_config(layers, hidden, intermediate, heads)
        cells, scoring = [], []
        for now in (False, True):
            peak, logits, n = traced_peak(config, sequences, now, True, checkpointing)
            # AdamW's share; the reference and the reward model (the policy's body, a one-output head)
            constant = 12 * n / GPUS + 2 * n + 2 * (n - VOCAB * hidden + hidden)
            cells.append(f"{peak / GB:.2f} | {logits / GB:.2f} | {(peak + constant) / GB:.2f} | "
                         f"{100 * logits / (peak + constant):.0f} %")
            scoring.append((traced_peak(config, sequences, now, False)[0] + constant) / GB)
        print(f"| {name} | {sequences} | {n / 1e9:.2f} B | {cells[0]} | {cells[1]} | {scoring[0]:.2f} "
              f"| {scoring[1]:.2f} |")


def measure_gpu():
    print(f"measured on {torch.cuda.get_device_name()}, bf16, {SEQUENCES} sequences x ({PROMPT} + {RESPONSE}) tokens; "
          "peak GB above the weights and their gradients")
    print("| model | parameters | training step: before | now | saved | scoring pass: before | now | saved |")
    print("|---|---|---|---|---|---|---|---|")
    from transformers import GPTNeoXForCausalLM
    for name, shape in PYTHIA.items():
        with torch.device("cuda"):
            model = GPTNeoXForCausalLM(pythia_config(*shape)).to(torch.bfloat16)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)  # held through the step as the optimizer's gradients are
        ids = torch.randint(0, VOCAB, (SEQUENCES, PROMPT + RESPONSE), device="cuda")
        peaks = []
        for train in (True, False):
            for now in (False, True):
                torch.cuda.synchronize()
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                run_pass(model, ids, VOCAB, PROMPT, now, train)
                torch.cuda.synchronize()
                peaks.append((torch.cuda.max_memory_allocated() - base) / GB)
        n = sum(p.numel() for p in model.parameters())
        print(f"| {name} | {n / 1e9:.2f} B | {peaks[0]:.2f} | {peaks[1]:.2f} | {peaks[0] - peaks[1]:.2f} "
              f"({100 * (1 - peaks[1] / peaks[0]):.0f} %) | {peaks[2]:.2f} | {peaks[3]:.2f} | {peaks[2] - peaks[3]:.2f} "
              f"({100 * (1 - peaks[3] / peaks[2]):.0f} %) |")
        del model, ids
        torch.cuda.empty_cache()


def cpu_pass(now, train):
    """One pass in this (fresh) process: the peak resident memory above that before it, in bytes."""
    import data
    path = os.path.join(ROOT, "assets", "smollm2", "model")
    tokenizer = data.load_tokenizer(path, False)
    model = data.load_model(rloo.Args(bf16=False), path)
    with open(os.path.join(ROOT, "assets", "smollm2", "data", "train.jsonl")) as f:
        prompts = [tokenizer.apply_chat_template(json.loads(line)["messages"], add_generation_prompt=True,
                                                 tokenize=False) for line, _ in zip(f, range(8))]
    queries = data.left_pad([tokenizer.encode(p, add_special_tokens=False) for p in prompts], tokenizer.pad_token_id,
                            "cpu").repeat(4, 1)
    torch.manual_seed(0)
    responses = torch.randint(0, 49152, (len(queries), 16))
    query_responses = torch.cat([queries, responses], 1)
    if train:
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
    with open("/proc/self/statm") as f:  # resident pages now (the peak so far may be the model's loading)
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    run_pass(model, query_responses, tokenizer.pad_token_id, queries.shape[1], now, train)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"bytes": peak - before, "length": query_responses.shape[1]}))


def measure_cpu():
    print("measured on this CPU, float32, SmolLM2-135M-Instruct, 32 sequences (8 chat prompts x 4) + 16-token "
          "responses; peak resident GB above that before the pass, each in a fresh process")
    results = {}
    for train in (True, False):
        for now in (False, True):
            out = subprocess.run([sys.executable, __file__, "--cpu-pass", str(int(now)), str(int(train))],
                                 capture_output=True, text=True, check=True, env={**os.environ, "OMP_NUM_THREADS": "2"})
            results[train, now] = json.loads(out.stdout.strip().splitlines()[-1])
    length = results[True, True]["length"]
    before, now = computed(32, length, 16, 49152, 4)
    print(f"sequence length {length}; computed logits' bytes of a training step: before {before / GB:.2f} GB, "
          f"now {now / GB:.2f} GB")
    print("| pass | before | now | saved |")
    print("|---|---|---|---|")
    for train, label in ((True, "training step"), (False, "scoring pass")):
        b, n = results[train, False]["bytes"] / GB, results[train, True]["bytes"] / GB
        print(f"| {label} | {b:.2f} | {n:.2f} | {b - n:.2f} ({100 * (1 - n / b):.0f} %) |")


def main():
    print(f"computed at the TL;DR shapes ({SEQUENCES} sequences x ({PROMPT} + {RESPONSE}) tokens, vocabulary {VOCAB}): "
          "the logits' bytes of one training step, GB")
    print("| precision | before | now | saved |")
    print("|---|---|---|---|")
    for label, weight_bytes in (("bf16", 2), ("float32", 4)):
        before, now = computed(SEQUENCES, PROMPT + RESPONSE, RESPONSE, VOCAB, weight_bytes)
        print(f"| {label} | {before / GB:.2f} | {now / GB:.2f} | {(before - now) / GB:.2f} |")
    print()
    measure_gpu() if torch.cuda.is_available() else measure_cpu()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--cpu-pass"]:
        cpu_pass(bool(int(sys.argv[2])), bool(int(sys.argv[3])))
    elif sys.argv[1:2] == ["--updates"]:
        computed_updates()
    else:
        main()
