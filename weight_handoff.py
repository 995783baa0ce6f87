"""Handing the learner's weights to vLLM after an update: through files (a save_pretrained directory vLLM reloads,
written here in the form vLLM needs: a tied output layer untied) or in memory (vLLM's weight transfer: NCCL to a GPU
of its own, CUDA IPC on one it shares), every wait bounded; and the weight check, which stops the run if vLLM does not
hold the learner's policy. When each version goes is generator.py's. Nothing here changes what is learned."""

import atexit
import contextlib
import functools
import hashlib
import math
import os
import re
import shutil
import sys
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from distributed import free_port, gathered_state_dict  # (first: it sets DS_ACCELERATOR before deepspeed is imported)
import deepspeed

from data import left_pad
from vllm_engine import engine_dead, in_thread, packed_buffer_bytes, wait_for


def weights_root(run_dir, needed_bytes, shm="/dev/shm"):
    """Where the weights handed to vLLM go: memory (/dev/shm) when it has room for `needed_bytes`, else the
    run directory, said in one line. A container's /dev/shm is often 64 MB."""
    if os.path.isdir(shm) and shutil.disk_usage(shm).free >= needed_bytes:
        return shm
    print(f"warning: {shm} has no room for {needed_bytes / 2**20:.0f} MiB of weights handed to vLLM; "
          f"they go through {run_dir} (disk)", file=sys.stderr, flush=True)
    return run_dir


def save_for_vllm(policy, path):
    """Write the policy's weights where vLLM can load them (write_for_vllm), or with LoRA only its adapter (peft's
    save_pretrained); every rank takes part, rank 0 writes."""
    state_dict = gathered_state_dict(policy)
    if dist.get_rank() == 0:
        if is_lora(policy.module):
            policy.module.save_pretrained(path, state_dict=state_dict)
        else:
            write_for_vllm(policy.module, state_dict, path)


def is_lora(module):
    """A peft model: only its LoRA adapter trains and goes to vLLM."""
    return hasattr(module, "peft_config")


def adapter_file_name(name):
    """The name peft's adapter file gives the LoRA parameter `name` of the base model (peft's own prefix, and no
    adapter name: `default`)."""
    return "base_model.model." + name.replace(".default.", ".")


def tied_output_names(module):
    """The names under which a model whose output layer is its input embedding (`tie_word_embeddings`: SmolLM2,
    Qwen2.5 up to 3B, Llama 3.2, Gemma) holds that weight a second time, such as ["lm_head.weight"]; else []."""
    embedding = module.get_input_embeddings().weight
    names = [name for name, p in module.named_parameters(remove_duplicate=False) if p is embedding]
    return names[1:]


# vLLM's classes (by the Hugging Face class they load) that compute logits from the input embedding and have no
# output layer: vLLM 0.32's models/gemma2.py, gemma3n.py, commandr.py (Cohere, Cohere2) and cohere2_moe.py.
LOGITS_FROM_EMBEDDING = {"Gemma2ForCausalLM", "Gemma3nForCausalLM", "CohereForCausalLM", "Cohere2ForCausalLM",
                         "Cohere2MoeForCausalLM"}


def untied_for_vllm(module):
    """The tied_output_names() that vLLM gets as weights of their own (write_for_vllm): all of them, but none where
    vLLM's class has no output layer (LOGITS_FROM_EMBEDDING, whose loader rejects one): there the tie stays, and
    each hand-off of the embedding is the output layer's too."""
    return [] if type(module).__name__ in LOGITS_FROM_EMBEDDING else tied_output_names(module)


def write_for_vllm(module, state_dict, path):
    """save_pretrained for vLLM: a tied output layer is written as a weight of its own, under a config that unties
    it (untied_for_vllm). vLLM 0.32 ties such a layer to its embedding when it first loads, and its reloads (both
    hand-offs) skip it (`lm_head.*`): vLLM would go on sampling with the first weights' output layer. Untied, vLLM's
    copy costs one more embedding matrix of memory and of every hand-off; the learner's model stays tied."""
    tied = untied_for_vllm(module)
    if tied:
        embedding = state_dict[next(n for n, p in module.named_parameters() if p is module.get_input_embeddings().weight)]
        state_dict = {**state_dict, **{name: embedding.clone() for name in tied}}
    config = module.config.get_text_config()
    saved = config.tie_word_embeddings
    config.tie_word_embeddings = saved and not tied
    try:
        module.save_pretrained(path, state_dict=state_dict)
    finally:
        config.tie_word_embeddings = saved


def weight_transfer(args, llm, module, rank):
    """The learner's end of the in-memory weight hand-off: vLLM's trainer-side engine for the backend vLLM's engine
    was started with (start_vllm: NCCL to a GPU of its own, CUDA IPC on one it shares), connected to it. Every rank
    calls this and its send_weights(): rank 0 sends, the others take part in ZeRO-3's gathers."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

    backend = [llm.llm_engine.vllm_config.weight_transfer_config.backend if rank == 0 else None]
    if args.world_size > 1:  # the other ranks learn it from rank 0
        dist.broadcast_object_list(backend, src=0)
    source = PolicyWeights(module)
    buffer_bytes = packed_buffer_bytes(max(math.prod(m.shape) * m.dtype.itemsize for m in source.metadata))
    if backend[0] == "nccl":  # one buffer: vLLM 0.32's receiver could reissue a block still read on another stream
        info = NCCLTrainerInitInfo("127.0.0.1", free_port(), 2, rank=rank, packed_buffer_size_bytes=buffer_bytes,
                                   packed_num_buffers=1)
    else:  # packed: in bounded chunks (unpacked, it would keep a copy of every tensor until the update ends)
        info = IPCTrainerInitInfo(rank=rank, packed=True, packed_buffer_size_bytes=buffer_bytes)
    if rank != 0:
        return WeightTransferTrainerFactory.trainer_init(info, client=None, source=source)
    client = VllmClient(llm, args.generation_timeout)
    with hand_off_watchdog("connecting to vLLM's worker", client):
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=source)


class ParamMetas(list):
    """vLLM's ParamMeta of each parameter: a list (vLLM 0.33 reads a weight source's `metadata`) that can be called
    for itself (vLLM 0.32 calls `metadata()`)."""

    def __call__(self):
        return self


class PolicyWeights:
    """The policy's parameters as vLLM's trainer-side weight transfer engines take them (a vLLM WeightSource, in
    vLLM 0.32's contract and 0.33's): their names, dtypes and shapes up front, then the tensors one at a time in the
    same order. Every rank iterates: under ZeRO-3 each module's parameters are gathered in turn and released after,
    so no device holds the whole model (every rank owns every name). A tied weight goes under each of its names that
    vLLM has: its copy is untied unless its class has no output layer (untied_for_vllm). `names` keeps only those."""

    def __init__(self, module, names=None):
        self.module, self.names = module, names
        self.kept_tied = set(tied_output_names(module)) - set(untied_for_vllm(module))

    def _by_module(self):
        for prefix, submodule in self.module.named_modules():
            own = [(name, p) for name, p in submodule.named_parameters(prefix=prefix, recurse=False,
                                                                        remove_duplicate=False)
                   if (self.names is None or name in self.names) and name not in self.kept_tied]
            if own:
                yield own

    @functools.cached_property
    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return ParamMetas(ParamMeta(name, p.dtype, tuple(getattr(p, "ds_shape", p.shape)))  # ds_shape: ZeRO-3's
                          for own in self._by_module() for name, p in own)                 # full shape

    def __iter__(self):  # vLLM 0.32
        for own in self._by_module():
            with deepspeed.zero.GatheredParameters([p for _, p in own]):  # does nothing unless ZeRO-3 partitioned them
                for name, p in own:  # a gathered parameter is copied: its memory goes when the context ends
                    yield name, p.detach().clone() if hasattr(p, "ds_id") else p.detach()

    def iter_full(self):  # vLLM 0.33
        return iter(self)

    def implements_iter_full(self):
        return True

    def implements_iter_local(self):
        return False

    def owned_names(self, rank):
        return [meta.name for meta in self.metadata]


class VllmClient:
    """vLLM's weight-sync calls on an engine (what vLLM's trainer-side weight transfer engines call: its
    VLLMWeightSyncClient), each bounded: a hand-off that hangs, the field's most reported failure, ends
    in an error naming its step, after `timeout` seconds or as soon as the engine process dies."""

    def __init__(self, llm, timeout):
        self.llm, self.timeout = llm, timeout
        self.failure = None  # the error of a call that failed, for hand_off_watchdog()
        self.abandoned = False  # set by hand_off_watchdog() when the learner's end fails: calls in flight end

    def init_weight_transfer_engine(self, init_info):
        self.call("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self):
        self.call("start_weight_update")

    def update_weights(self, update_info):
        self.call("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version=None):
        self.call("finish_weight_update")
        self.call("reset_prefix_cache")  # see load_into_vllm

    def call(self, step, *request):
        def check():
            if engine_dead(self.llm):
                raise RuntimeError(f"vLLM's engine process died during {step}")
            if self.abandoned:
                raise RuntimeError(f"{step} abandoned: the learner's end of the hand-off failed")

        # The learner may be in a collective vLLM's worker left or never joins: hand_off_watchdog() must know at once.
        try:
            result, error = wait_for(in_thread(getattr(self.llm, step), *request), step, self.timeout, check)
        except Exception as error:  # the engine died, or the call did not return in time
            self.failure = f"weight hand-off: {error}"
            raise
        if error is not None:  # raised in vLLM's worker (out of memory for its buffers, ...)
            cause = (str(error).strip().splitlines() or [type(error).__name__])[-1]  # a worker's traceback ends so
            self.failure = f"weight hand-off: {step} failed in vLLM: {cause}"
            raise error
        return result


@contextlib.contextmanager
def hand_off_watchdog(step, client):
    """Bound a hand-off step that may never return: in a collective (NCCL's broadcast, gloo's) whose other end died or
    hangs, the learner waits for ever, out of any exception's reach. If the block still runs 5 s after `client` (a
    VllmClient) reports a failed call, or 5 s past its timeout, print one line naming the step, run the atexit clean-ups
    (vLLM's engine processes, the weights directory) and exit with code 1. Errors the block raises go the usual way,
    and end the client's calls in flight: vLLM's NCCL sender leaves its worker's update_weights running in a thread
    that Python joins at exit, which would otherwise wait for the worker (never, as it waits in the broadcast)."""
    ended = threading.Event()

    def watch():
        started, failed = time.time(), None
        while not ended.wait(0.1):
            failed = failed or (client.failure and time.time())
            if (failed and time.time() > failed + 5) or time.time() > started + client.timeout + 5:
                message = client.failure or f"weight hand-off: {step} did not end in {client.timeout} s (--generation-timeout)"
                print(f"error: {message}", file=sys.stderr, flush=True)
                atexit._run_exitfuncs()  # the main thread, stuck, will never run them
                os._exit(1)

    threading.Thread(target=watch, name="hand-off watchdog", daemon=True).start()
    try:
        yield
    except BaseException:
        client.abandoned = True
        raise
    finally:
        ended.set()


def send_weights(transfer, version):
    """Send the policy's weights to vLLM in memory by `transfer` (weight_transfer()): every rank calls this, rank 0
    sends under hand_off_watchdog(); vLLM's worker loads them when the generator finishes the update. A failure is
    raised as a RuntimeError naming the version."""
    try:
        if torch.cuda.is_available():  # the optimizer's step may still run on the default stream, and vLLM's NCCL
            torch.cuda.current_stream().synchronize()  # packer reads the parameters on streams of its own
        client = getattr(transfer, "client", None)  # rank 0's
        with hand_off_watchdog(f"sending version {version}", client) if client else contextlib.nullcontext():
            transfer.send_weights()
    except Exception as error:
        raise RuntimeError(f"handing version {version} of the policy to vLLM failed: {error}") from error


class WeightCheck(NamedTuple):
    """What vLLM must hold after loading a policy version, per the learner at hand-over (check_vllm_weights() compares):
    the probe tokens' log-probabilities (with LoRA: those of the likeliest next `tokens`, and of the same tokens under
    the base model, the adapter off) and the digests of the parameters that matched when vLLM started."""
    logprobs: list
    digests: dict
    tokens: list = None
    base_logprobs: list = None


class WeightsDiffer(Exception):
    """vLLM does not hold the learner's weights: the run stops with this one line."""


# The mean |difference| of log-probabilities allowed, by --bf16 (what vLLM and the learner give with the same weights:
# docs/online_dpo_vllm.md, the weight check).
PROBE_TOLERANCE = {False: 1e-3, True: 0.25}
# With LoRA, the mean |difference| between the learner's probe log-probabilities and the base model's (its adapter off)
# above which vLLM's must be closer to the learner's than to the base's (below it, vLLM's own noise, about 0.07 in
# bfloat16 on SmolLM2, could decide): an adapter that vLLM applies only in part, or not at all, while it is young.
ADAPTER_MOVED = {False: 1e-4, True: 0.1}


def follows_the_adapter(vllm, learner, base, bf16):
    """Whether vLLM's log-probabilities (flat lists) are closer to the learner's under its adapter than to the base
    model's, wherever the adapter has moved the learner's by more than ADAPTER_MOVED on average."""
    vllm, learner, base = (torch.tensor(values, dtype=torch.float64) for values in (vllm, learner, base))
    if (learner - base).abs().mean() <= ADAPTER_MOVED[bf16]:
        return True
    return bool((vllm - learner).abs().mean() < (vllm - base).abs().mean())


# vLLM fuses q/k/v projections into one qkv_proj and gate/up into gate_up_proj, in that order along the output
# dimension; on CUDA an unquantized fused weight is its parts' bytes one after the other.
FUSED = ((re.compile(r"(.*)\.[qkv]_proj\.(weight|bias)$"), r"\1.qkv_proj.\2"),
         (re.compile(r"(.*)\.(gate|up)_proj\.weight$"), r"\1.gate_up_proj.weight"))


def fused_name(name):
    """The name of the tensor vLLM fuses parameter `name` into, or None."""
    return next((pattern.sub(fused, name) for pattern, fused in FUSED if pattern.match(name)), None)


def weight_digests(named_tensors, names=None):
    """sha256 of each tensor's bytes, as vLLM's own compute_weight_checksums hashes its parameters, and of each fused
    tensor vLLM makes of several (fused_name(): its parts' bytes in the order they come, that of the model's modules:
    q, k, v and gate, up); only `names` (None: all)."""
    hashes = {}
    for name, tensor in named_tensors:
        data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()
        for key in (name, fused_name(name)):
            if key is not None and (names is None or key in names):
                hashes.setdefault(key, hashlib.sha256()).update(data)
    return {name: digest.hexdigest() for name, digest in hashes.items()}


def digests_to_check(expected, held, on_gpu):
    """The tensors whose digests the weight check compares, of the learner's `expected` digests ({name: digest}, the
    fused tensors vLLM makes included): those vLLM `held` alike when it started. On a CPU vLLM repacks its linear
    layers for its kernels (embeddings and norms are left); on a GPU it keeps every tensor byte for byte, so a fused
    tensor (FUSED) left out means that the rule for it is wrong, and the check would pass unnoticed: WeightsDiffer.
    Says in one line what is compared and what is left out."""
    names = sorted(name for name, digest in expected.items() if held.get(name) == digest)
    left_out = sorted(set(expected) - set(names))
    fused = [name for name in left_out if any(f"{part}." in name for part in ("qkv_proj", "gate_up_proj"))]
    if on_gpu and fused:
        raise WeightsDiffer(f"the weight check's rule for vLLM's fused tensors (weight_handoff.FUSED) does not give "
                            f"vLLM's digest of {', '.join(fused[:3])}{' ...' if len(fused) > 3 else ''}: fix the rule")
    why = "vLLM repacks them for its CPU kernels" if not on_gpu else "vLLM fuses them or does not hold them"
    print(f"weight check: the probe's log-probabilities and the digests of {len(names)} of {len(expected)} tensors"
          f"{f' ({len(left_out)} left out: {why}, such as {left_out[0]})' if left_out else ''}", flush=True)
    return names


def vllm_digests(llm, adapter=None):
    """vLLM's digest of each parameter of its model (one worker: no tensor parallelism), by parameter name, and with
    an `adapter` (a LoRARequest) those of the adapter file it was given."""
    (digests,) = llm.collective_rpc("compute_weight_checksums")
    # "dp0:pp0:pcp0:tp0:<name>"; with LoRA enabled vLLM holds a linear layer's weight as <layer>.base_layer.weight
    digests = {name.rsplit(":", 1)[-1].replace(".base_layer.", "."): digest for name, digest in digests.items()}
    if adapter is not None:
        from safetensors.torch import load_file

        digests.update(weight_digests(load_file(os.path.join(adapter.lora_path, "adapter_model.safetensors")).items()))
    return digests


@torch.no_grad()
def expected_weights(policy, probe, names, pad_token_id, device):
    """The WeightCheck vLLM must pass when it holds the learner's current policy (all ranks take part; rank 0's is
    used): log-probabilities at temperature 1 of each probe sequence's tokens after its first, and digests of `names`
    (None: all parameters, under each name, and the tensors vLLM fuses from them)."""
    ids = left_pad(probe, pad_token_id, device)
    mask = ids != pad_token_id  # padding reads token 0 (its id may lie past the vocabulary) and is cut off below
    ids = ids.masked_fill(~mask, 0)
    logits = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                    use_cache=False).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    tokens = base_logprobs = None
    if is_lora(policy.module):
        # check_vllm_weights compares the likeliest next tokens' log-probabilities (also the base model's: the adapter
        # off), and the digests of the frozen base weights under vLLM's names and of the adapter under its file's
        logprobs, tokens = torch.log_softmax(logits, -1).max(-1)
        with policy.module.disable_adapter():
            base_logits = policy(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(1) - 1).clamp(min=0),
                                 use_cache=False).logits[:, :-1].float()
        base_logprobs = torch.log_softmax(base_logits, -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
        base_logprobs = [row[len(row) - len(p) + 1:].tolist() for row, p in zip(base_logprobs, probe)]
        tokens = [row[len(row) - len(p) + 1:].tolist() for row, p in zip(tokens, probe)]
        base = PolicyWeights(policy.module.get_base_model())
        named = ((adapter_file_name(name) if "lora_" in name else name.replace(".base_layer", ""), tensor)
                 for name, tensor in base)
        digests = weight_digests(named, names)
    else:
        parts = None if names is None else {name for name, _ in policy.module.named_parameters(remove_duplicate=False)
                                            if name in names or fused_name(name) in names}
        digests = weight_digests(PolicyWeights(policy.module, parts), names)
    return WeightCheck([row[len(row) - len(p) + 1:].tolist() for row, p in zip(logprobs, probe)], digests, tokens,
                       base_logprobs)


def probe_requests(probe, adapter=None):
    """The weight check's vLLM requests, (token ids, SamplingParams): each probe prompt's log-probabilities (temperature
    1), one token greedily; under a LoRA adapter, whose prompt log-probabilities vLLM gets wrong (vLLM #29955, #51594),
    a request per prefix of the probe instead, for the five likeliest next tokens."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    if adapter is None:
        return [(p, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, detokenize=False,
                                   output_kind=RequestOutputKind.FINAL_ONLY)) for p in probe]
    sampling = SamplingParams(max_tokens=1, temperature=0, logprobs=5, detokenize=False,
                              output_kind=RequestOutputKind.FINAL_ONLY)
    return [(p[:t], sampling) for p in probe for t in range(1, len(p))]


def check_vllm_weights(llm, version, probe, expected, bf16, adapter=None, probe_outputs=None):
    """Raise WeightsDiffer (the run stops) unless vLLM holds policy version `version`: its prompt log-probabilities of
    the probe (temperature 1) within PROBE_TOLERANCE of the learner's, every expected digest equal. With LoRA,
    version's `adapter` must be loaded in vLLM, the probe runs with it, and its file holds the learner's adapter.
    `probe_outputs`: vLLM's outputs of the probe's requests (probe_requests()) where the caller generated them (the
    streaming generator, amid its requests in flight), else generated here."""
    from vllm.inputs import TokensPrompt

    if adapter is not None and (adapter.lora_name != f"policy-{version}" or
                                adapter.lora_int_id not in llm.llm_engine.list_loras()):
        raise WeightsDiffer(f"vLLM does not hold the LoRA adapter of version {version} of the learner's policy: it "
                            f"generates with {adapter.lora_name}'s, and holds adapters "
                            f"{sorted(llm.llm_engine.list_loras())} (--check-weights-every)")
    requests = probe_requests(probe, adapter)
    outputs = probe_outputs or llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in requests],
                                            [sampling for _, sampling in requests], lora_request=adapter,
                                            use_tqdm=False)
    if adapter is None:
        vllm_logprobs = [[step[token].logprob for token, step in zip(p[1:], out.prompt_logprobs[1:])]
                         for p, out in zip(probe, outputs)]
    else:  # the learner's likeliest next tokens are among vLLM's five where they agree
        outputs = iter(outputs)
        vllm_logprobs = [[getattr(next(outputs).outputs[0].logprobs[0].get(token), "logprob", -math.inf)
                          for token in tokens] for tokens in expected.tokens]
    difference = torch.tensor([v - e for got, want in zip(vllm_logprobs, expected.logprobs)
                               for v, e in zip(got, want)]).abs()
    digests = vllm_digests(llm, adapter) if expected.digests else {}
    differ = [name for name, digest in expected.digests.items() if digests.get(name) != digest]
    if differ or not difference.mean() <= PROBE_TOLERANCE[bf16]:
        where = (f"parameters that differ: {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''}" if differ else
                 f"largest at probe token {difference.argmax().item()}; no parameter vLLM keeps as the learner does differs")
        raise WeightsDiffer(f"vLLM does not hold version {version} of the learner's policy: its log-probabilities of "
                            f"the probe differ by {difference.mean():.2e} on average (tolerance "
                            f"{PROBE_TOLERANCE[bf16]:.0e}); {where} (--check-weights-every)")
    flat = [[value for row in rows for value in row] for rows in (vllm_logprobs, expected.logprobs,
                                                                  expected.base_logprobs or [])]
    if adapter is not None and not follows_the_adapter(*flat, bf16):
        raise WeightsDiffer(f"vLLM does not apply the LoRA adapter of version {version} of the learner's policy (not "
                            "all of it): its log-probabilities of the probe are closer to the base model's than to "
                            "the learner's (--check-weights-every)")
