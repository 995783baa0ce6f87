"""The asynchrony of the *_vllm.py scripts as one object, AsyncGeneration: vLLM on rank 0, fed by a background thread
that generates each batch with the policy version the script's schedule names, while the learner trains; after each
update the weights handed to vLLM (weight_handoff.py) and, when --check-weights-every says, checked there; the batches
generated but not yet trained on kept in checkpoints, so a resumed run is exact. Nothing here changes what is learned:
the script passes its schedule (generating_version: the paper's K) and its sampling request (vllm_generate)."""

import atexit
import collections
import contextlib
import json
import math
import os
import queue
import shutil
import signal
import sys
import threading
import time
from typing import NamedTuple

import torch
import torch.distributed as dist
from tqdm import tqdm
from transformers import AutoTokenizer

from checkpoints import latest_checkpoint, resume_hint
from data import prompt_batch
from vllm_engine import (add_adapter, engine_dead, engine_exit, in_memory_backend, load_into_vllm, pin_vllm_to_its_cores,
                         shut_down, start_vllm, swap_adapter, vllm_gpu, wait_for)
from weight_handoff import (VllmClient, WeightsDiffer, check_vllm_weights, digests_to_check, expected_weights, is_lora,
                            save_for_vllm, send_weights, vllm_digests, weight_transfer, weights_root)


class AsyncGeneration:
    """The generation side of an asynchronous run, on every rank: made once in the set-up, then get() takes each
    update's batch (step 1), hand_over() gives vLLM the new weights (step 5), checkpoint_files() is what a checkpoint
    keeps of it, close() ends it (also at exit, on every way out).

    On rank 0, vLLM starts from the learner's weights (version start_update: the SFT policy or the resumed one), then a
    GenerationThread generates batch t with version schedule(t, start_update, off_policy_steps). Later versions go in
    memory (--weight-sync memory) or through save_pretrained directories, in /dev/shm if it has room for the K + 1
    versions that can be in flight at once, else in the run directory, each deleted once loaded; rank 0's process id
    keeps two runs of one name (a sweep) apart. With LoRA (a peft policy) vLLM starts from the base model and each
    version is only the adapter's directory, which vLLM adds as an adapter of its own while it drops the one before
    (vllm_engine.swap_adapter); the base weights are never reloaded. `sample` is the script's sampling request
    (vllm_generate); `probe`, token lists whose log-probabilities the weight check compares."""

    def __init__(self, args, policy, run_dir, tokenizer, stop_id, train_prompts, probe, k, start_update,
                 off_policy_steps, schedule, sample):
        self.args, self.probe, self.pad_id = args, probe, tokenizer.pad_token_id
        self.first_version, self.off_policy_steps, self.schedule = start_update, off_policy_steps, schedule
        self.rank, self.thread, self.run_dir, self.update = dist.get_rank(), None, run_dir, start_update
        self.in_memory = args.weight_sync == "memory"
        if self.in_memory:  # rank 0 (vLLM's) decides: CUDA IPC leaks with several training ranks
            shared = vllm_gpu(args)[1] if self.rank == 0 and torch.cuda.is_available() else None
            backend = [in_memory_backend(shared, args.world_size)]
            dist.broadcast_object_list(backend, src=0)
            if backend[0] is None:
                self.in_memory = False
                if self.rank == 0:
                    print(f"vLLM shares rank 0's GPU with {args.world_size} training ranks: the weights go through "
                          "files (--weight-sync file); vLLM's CUDA IPC hand-off would strand a buffer on every other "
                          "rank at every update", flush=True)
        lora = is_lora(policy.module)  # then only the adapter goes to vLLM, which keeps the base weights it started with
        handed = [p for p in policy.module.parameters() if p.requires_grad or not lora]
        version_bytes = sum(getattr(p, "ds_numel", p.numel()) for p in handed) * (2 if args.bf16 else 4)
        copies = 1 if self.in_memory else off_policy_steps + 1
        root = weights_root(run_dir, copies * version_bytes) if self.rank == 0 else run_dir  # only rank 0 writes
        self.weights_dir = os.path.join(root, f"{os.path.basename(run_dir)}-{os.getpid()}-weights")
        exit_on_signals()
        atexit.register(shutil.rmtree, self.weights_dir, ignore_errors=True)
        first = os.path.join(self.weights_dir, f"policy-{start_update}")
        save_for_vllm(policy, first)
        llm = adapter = None
        if self.rank == 0:
            largest = max(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in policy.module.parameters())
            if not lora:
                AutoTokenizer.from_pretrained(args.sft_model_path, trust_remote_code=args.trust_remote_code).save_pretrained(first)
            try:  # with LoRA from the base model, and version start_update's adapter
                llm = start_vllm(args, args.sft_model_path if lora else first, self.in_memory, largest,
                                 lora_rank=policy.module.peft_config["default"].r if lora else 0)
                adapter = add_adapter(llm, start_update, first) if lora else None
            except Exception as error:  # vLLM logged the cause above
                self.stop(f"vLLM's engine did not start: {(str(error).strip().splitlines() or [repr(error)])[0]}")
            if not lora:
                shutil.rmtree(first)
            print(f"the policy goes to vLLM after each update {'in memory' if self.in_memory else 'as files'}: "
                  f"{'its LoRA adapter, ' if lora else ''}{version_bytes / 2**20:.1f} MiB", flush=True)
            resumed = load_generated_batches(latest_checkpoint(args.resume)) if args.resume else []
            self.thread = GenerationThread(args, llm, sample, schedule, weights_dir=self.weights_dir,
                                           train_prompts=train_prompts, prompts_per_rank=args.local_batch_size // k,
                                           k=k, stop_id=stop_id, first_version=start_update,
                                           off_policy_steps=off_policy_steps, probe=probe, in_memory=self.in_memory,
                                           adapter=adapter, resumed_batches=resumed)
            atexit.register(self.thread.close)  # on every way out: the end, an error, Ctrl-C, SIGTERM
        # The weight check (--check-weights-every): vLLM's log-probabilities of the probe against the learner's, and the
        # digests of the tensors vLLM keeps as the learner does (found now: on a GPU every one, the fused q/k/v and
        # gate/up included, weight_handoff.FUSED; on a CPU vLLM repacks its linear layers, so embeddings and norms),
        # first here, then after hand-offs.
        checked_names = [None]
        if args.check_weights_every:
            expected = expected_weights(policy, probe, None, self.pad_id, policy.device)
            if self.rank == 0:
                try:
                    checked_names = [digests_to_check(expected.digests, vllm_digests(llm, adapter),
                                                      torch.cuda.is_available())]
                    check_vllm_weights(llm, start_update, probe, expected._replace(
                        digests={n: expected.digests[n] for n in checked_names[0]}), args.bf16, adapter)
                except WeightsDiffer as error:
                    sys.exit(f"error: {error}")
            dist.broadcast_object_list(checked_names, src=0)
        self.checked_names = checked_names[0]
        # The in-memory hand-off connects before the generator starts: then only its thread uses vLLM (but while it
        # waits for weights, see GenerationThread.wait_for_receiver()).
        self.transfer = weight_transfer(args, llm, policy.module, self.rank) if self.in_memory else None
        if self.rank == 0:
            self.thread.start()

    def get(self):
        """The next update's GeneratedBatch, on every rank (rank 0's thread generated it; each rank takes its share)."""
        self.update += 1
        batch = [None]
        if self.rank == 0:
            try:
                batch = [self.thread.get()]
            except GenerationFailed as error:  # every rank stops, rank 0 says why
                batch = [str(error)]
        dist.broadcast_object_list(batch, src=0)
        if isinstance(batch[0], str):
            self.stop(batch[0])
        return batch[0]

    def hand_over(self, policy, update):
        """Give vLLM the policy after `update` updates if the schedule has a later batch generated by it (every rank
        calls this): in memory, or as a save_pretrained directory the generator loads; at the updates the weight check
        is due (the first hand-off, then every --check-weights-every), the generator then checks vLLM's weights.
        Returns the seconds waited for the generator to finish older policies' batches."""
        args = self.args
        if self.schedule(args.num_updates, self.first_version, self.off_policy_steps) < update:
            return 0.0
        check = args.check_weights_every and (update == self.first_version + 1 or update % args.check_weights_every == 0)
        expected = expected_weights(policy, self.probe, self.checked_names, self.pad_id, policy.device) if check else None
        path, waited = None, 0.0
        if not self.in_memory:
            path = os.path.join(self.weights_dir, f"policy-{update}")
            save_for_vllm(policy, path)
        else:
            if self.thread is not None:  # vLLM's weights change between batches only, when the generator wants them
                start = time.time()
                self.thread.wait_for_receiver(update)
                waited = time.time() - start
            try:
                send_weights(self.transfer, update)
            except RuntimeError:
                if self.thread is not None:  # the likeliest cause: vLLM's engine died ("the generator failed: ...")
                    try:
                        self.thread.raise_if_failed()
                    except GenerationFailed as error:
                        self.stop(str(error))
                raise
        if self.thread is not None:
            self.thread.publish(update, path, finish=getattr(self.transfer, "finish", None), expected=expected)
        return waited

    def checkpoint_files(self, update):
        """What a checkpoint at `update` keeps: the batches already generated for the next K updates (by policies
        older than its own), which a resumed run trains on as this one will, so that it resumes exactly."""
        ahead = self.thread.peek(min(self.off_policy_steps, self.args.num_updates - update)) if self.rank == 0 else []
        return {GENERATED_BATCHES: [batch._asdict() for batch in ahead]}

    def stop(self, failure):
        """End the run on a fault of the generation side: one line on rank 0 naming it, the update and the checkpoint
        to resume from; exit code 1 on every rank (the atexit clean-ups end vLLM's processes, delete the weights)."""
        if self.rank == 0:
            tqdm.write(f"error: {failure} (update {self.update}); {resume_hint(self.run_dir)}", file=sys.stderr)
        sys.exit(1)

    def close(self):
        if self.thread is not None:
            self.thread.close()


class GenerationFailed(RuntimeError):
    """The generator thread failed, or vLLM's engine died: AsyncGeneration stops the run in one line."""


class GeneratedBatch(NamedTuple):
    """One update's batch: the policy version that generated it, each rank's responses (sample j of prompt i at
    j * prompts_per_rank + i) and their tokens' log-probabilities under that version (the behaviour policy), and
    the seconds spent generating it and loading its version into vLLM."""
    version: int
    responses: list
    logprobs: list
    generation_time: float
    load_time: float


GENERATED_BATCHES = "generated_batches.json"


def load_generated_batches(checkpoint):
    """The batches a checkpoint kept for the updates after it (none from --sync runs or older checkpoints)."""
    path = os.path.join(checkpoint, GENERATED_BATCHES)
    if dist.get_rank() != 0 or not os.path.exists(path):
        return []
    with open(path) as f:
        return [GeneratedBatch(**batch) for batch in json.load(f)]


class GenerationThread:
    """vLLM on rank 0, generating in a background thread while the learner trains: the engine runs in its own process,
    so generation and training overlap; this thread only feeds it, each batch with the version the script's schedule
    names, which it waits for. AsyncGeneration hands it every version with publish() (in memory: sending it while the
    generator waits, see wait_for_receiver()) and takes the batches, in order, with get(). Every wait is bounded by
    --generation-timeout; a generator error or vLLM's engine dying is raised in the learner."""

    def __init__(self, args, llm, vllm_generate, schedule, *, weights_dir, train_prompts, prompts_per_rank, k, stop_id,
                 first_version, off_policy_steps, probe, in_memory, adapter=None, resumed_batches=()):
        self.args, self.llm, self.weights_dir, self.stop_id, self.probe = args, llm, weights_dir, stop_id, probe
        self.adapter = adapter  # with LoRA: the LoRARequest of the version vLLM generates with
        self.vllm_generate, self.schedule = vllm_generate, schedule  # the script's sampling request and schedule
        self.in_memory = in_memory
        self.train_prompts, self.prompts_per_rank, self.k = train_prompts, prompts_per_rank, k
        self.first_version, self.off_policy_steps = first_version, off_policy_steps
        self.batches, self.versions, self.receivers = queue.Queue(), queue.Queue(), queue.Queue()
        # Batches get() returns before the queue's: those a checkpoint kept (not generated again), then peek()'s.
        self.ahead = collections.deque(resumed_batches)
        self.first_update = first_version + 1 + len(self.ahead)
        self.error, self.stopping = None, threading.Event()
        self.thread = threading.Thread(target=self._run, name="generator", daemon=True)

    def start(self):
        self.thread.start()

    def publish(self, version, weights_path=None, finish=None, expected=None):
        """Hand the generator version `version`: a save_pretrained directory it loads and deletes, or None (in memory;
        `finish`, if given, completes the update); given `expected` (a WeightCheck) it checks vLLM's weights."""
        self.versions.put((version, weights_path, finish, expected))

    def wait_for_receiver(self, version):
        """Wait until the generator has generated every batch of older policies and waits for this version: then the
        learner may replace vLLM's weights in memory."""
        ready = self._take(self.receivers, f"the generator's batches before version {version} of the policy",
                           check=self.raise_if_failed)
        assert ready == version, (ready, version)

    def get(self):
        """The next GeneratedBatch; raises the generator's error, or the engine's death, as soon as either happens."""
        if self.ahead:
            return self.ahead.popleft()
        return self._take(self.batches, "a generation batch", check=self.raise_if_failed)

    def peek(self, n):
        """The next n batches, left for get(): for a checkpoint, which keeps the batches generated for the next K
        updates (by policies older than the checkpoint's, so they are waited for, not regenerated on resume)."""
        while len(self.ahead) < n:
            self.ahead.append(self._take(self.batches, "a generation batch", check=self.raise_if_failed))
        return list(self.ahead)[:n]

    def close(self):
        """Stop the thread and the engine and delete the handed-over weights (safe to call twice)."""
        self.stopping.set()
        if self.in_memory and not engine_dead(self.llm):
            with contextlib.suppress(Exception):  # else vLLM's worker, holding the connection, exits 10 s later
                VllmClient(self.llm, timeout=5).call("shutdown_weight_transfer_engine")
        shut_down(self.llm)
        if self.thread.is_alive():
            self.thread.join(timeout=5)  # a daemon: if it is stuck in a dead engine, the process exits without it
        shutil.rmtree(self.weights_dir, ignore_errors=True)

    def raise_if_failed(self):
        if isinstance(self.error, WeightsDiffer):  # the weight check, run in the thread after a hand-off
            raise GenerationFailed(str(self.error))
        if engine_dead(self.llm):  # first: the likeliest cause of an error in the thread too
            raise GenerationFailed(f"the generator failed: vLLM's engine process died{engine_exit(self.llm)}")
        if self.error is not None:
            raise GenerationFailed(f"the generator failed: {self.error!r}") from self.error

    def _take(self, source, what, check, timeout=None):
        """The next item of a queue, waiting at most `timeout` (default --generation-timeout) seconds and calling
        `check` meanwhile."""
        def checks():
            check()
            if self.stopping.is_set():
                raise RuntimeError("the learner stopped")

        return wait_for(source, what, self.args.generation_timeout if timeout is None else timeout, checks)

    def _run(self):
        args, world_size = self.args, self.args.world_size
        try:
            pin_vllm_to_its_cores(args)
            loaded = self.first_version
            for update in range(self.first_update, args.num_updates + 1):
                t0 = time.time()
                while loaded < self.schedule(update, self.first_version, self.off_policy_steps):
                    self.receivers.put(loaded + 1)  # for wait_for_receiver(): vLLM is idle until the next version
                    # No deadline: the next version comes after the learner's update, evaluation and checkpoint,
                    # however long they take; the learner's own waits are bounded, and its stopping ends this one.
                    loaded, weights_path, finish, expected = self._take(self.versions, "waiting for new weights",
                                                                        check=lambda: None, timeout=math.inf)
                    if self.adapter is not None:  # LoRA: the new adapter in, the old one out (the base stays)
                        self.adapter = swap_adapter(self.llm, self.adapter, loaded, weights_path)
                    elif weights_path is not None:
                        load_into_vllm(self.llm, weights_path)
                        shutil.rmtree(weights_path, ignore_errors=True)
                    if finish is not None:
                        finish()
                    if expected is not None:
                        check_vllm_weights(self.llm, loaded, self.probe, expected, args.bf16, self.adapter)
                t1 = time.time()
                # Every rank's prompts, rank after rank, as the synchronous scripts choose them.
                prompts = [self.train_prompts[i] for r in range(world_size) for i in
                           prompt_batch(len(self.train_prompts), self.prompts_per_rank, update - 1, args.seed, r,
                                        world_size)]
                # Request i gets this seed + i: seeds never repeat across batches (vllm_generate() says why).
                responses, logprobs = self.vllm_generate(self.llm, prompts, self.k, args.response_length, self.stop_id,
                                                         args.temperature, seed=args.seed * 2**32 + update * args.batch_size,
                                                         adapter=self.adapter)
                # vLLM returns sample j of prompt p at j * len(prompts) + p, and rank r's prompt i is p =
                # r * prompts_per_rank + i: regroup per rank, sample-major like the synchronous scripts' batches.
                order = [[j * len(prompts) + r * self.prompts_per_rank + i for j in range(self.k)
                          for i in range(self.prompts_per_rank)] for r in range(world_size)]
                self.batches.put(GeneratedBatch(loaded, [[responses[n] for n in rank] for rank in order],
                                                [[logprobs[n] for n in rank] for rank in order],
                                                time.time() - t1, t1 - t0))
        except BaseException as error:  # handed to the learner, which raises it
            self.error = error


def exit_on_signals():
    """Make SIGTERM and SIGINT exit through the atexit clean-ups (vLLM's engine processes, the weights directory), also
    while vLLM starts, where a KeyboardInterrupt would be lost. A job started with `&` keeps ignoring Ctrl-C."""
    for signum in (signal.SIGTERM, signal.SIGINT):
        if signal.getsignal(signum) is not signal.SIG_IGN:
            signal.signal(signum, lambda signum, frame: sys.exit(128 + signum))
