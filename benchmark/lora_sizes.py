"""LoRA against full fine-tuning at 0.5B, 1.5B, 8B and 70B parameters, computed from the models' configurations (their
layer counts and widths, typed in from each model's config.json: nothing is downloaded): the adapter's parameters and
the bytes one hand-off moves, and the GPU memory the weights and optimizer state take, with what then fits on one
80 GB GPU.

The adapter is rank 16 on every linear layer of every block (q, k, v, o, gate, up, down: the scripts' all-linear),
not on the output layer. Memory counts weights and optimizer state only, in GB (1e9 bytes):
- a trained parameter takes 16 bytes (bf16 weight and gradient, fp32 master weight and Adam's two moments);
- a frozen one 2 bytes (bf16): full fine-tuning's reference copy, LoRA's base;
- on one GPU the run also holds a reward model of the policy's size and vLLM's copy of the policy (2 bytes a parameter
  each). It fits when that total leaves 20 GB of the 80 for activations, vLLM's KV cache and CUDA's context.

    python benchmark/lora_sizes.py | tee benchmark/results/lora_sizes.txt
"""

# name: (layers, hidden, intermediate, attention heads, key-value heads, head dim, vocabulary, tied embeddings,
#        q/k/v biases)
MODELS = {
    "Qwen2.5-0.5B": (24, 896, 4864, 14, 2, 64, 151936, True, True),
    "Qwen2.5-1.5B": (28, 1536, 8960, 12, 2, 128, 151936, True, True),
    "Llama-3.1-8B": (32, 4096, 14336, 32, 8, 128, 128256, False, False),
    "Llama-3.1-70B": (80, 8192, 28672, 64, 8, 128, 128256, False, False),
}
RANK, GB, GPU_GB, HEADROOM_GB = 16, 1e9, 80, 20


def sizes(layers, hidden, intermediate, heads, kv_heads, head_dim, vocab, tied, qkv_bias):
    """(parameters, LoRA parameters at RANK): every linear layer of a block as (inputs, outputs)."""
    linear = [(hidden, heads * head_dim), (hidden, kv_heads * head_dim), (hidden, kv_heads * head_dim),
              (heads * head_dim, hidden), (hidden, intermediate), (hidden, intermediate), (intermediate, hidden)]
    biases = (heads + 2 * kv_heads) * head_dim if qkv_bias else 0
    block = sum(i * o for i, o in linear) + biases + 2 * hidden  # two RMSNorm weights
    parameters = layers * block + vocab * hidden * (1 if tied else 2) + hidden  # embeddings, output layer, final norm
    return parameters, layers * sum(RANK * (i + o) for i, o in linear)


def main():
    print(f"# rank {RANK} on every linear layer of every block; memory in GB (1e9 bytes), weights and optimizer state")
    print("| model | parameters | LoRA parameters | hand-off: adapter (MB) | hand-off: full (GB) | learner, full (GB) "
          "| learner, LoRA (GB) | one 80 GB GPU, full | one 80 GB GPU, LoRA |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, config in MODELS.items():
        n, a = sizes(*config)
        full = (16 * n + 2 * n) / GB  # the policy trained, its reference copy
        lora = (2 * n + 16 * a) / GB  # the frozen base (also the reference), the adapter trained
        on_gpu = {mode: learner + 4 * n / GB for mode, learner in (("full", full), ("lora", lora))}
        fits = {mode: f"{'yes' if total <= GPU_GB - HEADROOM_GB else 'no'} ({total:.0f} GB)" for mode, total in on_gpu.items()}
        print(f"| {name} | {n / 1e9:.2f} B | {a / 1e6:.1f} M ({100 * a / n:.2f} %) | {2 * a / 1e6:.0f} | {2 * n / GB:.1f} "
              f"| {full:.0f} | {lora:.1f} | {fits['full']} | {fits['lora']} |")


if __name__ == "__main__":
    main()
