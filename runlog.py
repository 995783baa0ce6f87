"""The run's directory and record: metrics.jsonl (rank 0), with --track wandb (with a code snapshot of the script and of
these modules), trace.json (every rank's timeline.py phases), and on the console the progress bar, each evaluation's
scores and the signs of a collapsing policy. Nothing here changes what is learned."""

import atexit
import json
import os
import shutil
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from tqdm import tqdm

import timeline
from checkpoints import latest_checkpoint
from distributed import vllm_gpu


def run_directory(args):
    """(name, directory) of the run: the resumed run's, or <output_dir>/<exp_name>__<seed>__<rank 0's time>."""
    run_dir = os.path.dirname(os.path.abspath(latest_checkpoint(args.resume))) if args.resume else None
    name = [os.path.basename(run_dir) if run_dir else f"{args.exp_name}__{args.seed}__{int(time.time())}"]
    dist.broadcast_object_list(name, src=0)  # every rank uses rank 0's clock
    return name[0], run_dir or os.path.join(os.path.abspath(args.output_dir), name[0])


class RunLog:
    """The run's record, written by rank 0: metrics.jsonl in the run directory (on resume, the lines logged
    after the checkpoint are dropped), with --track wandb, and on the console a progress bar in episodes and each
    evaluation's scores with two of its samples."""

    def __init__(self, args, run_dir, run_name, start_update, episode):
        self.writer, self.track = dist.get_rank() == 0, args.track
        self.batch_size, self.world_size = args.batch_size, dist.get_world_size()
        # the run's GPUs, for its per-GPU rates: vLLM's placement is rank 0's to know, and only rank 0 writes
        on_cuda = torch.cuda.is_available() and self.writer
        self.gpus = run_gpus(self.world_size, on_cuda, vllm_gpu(args) if on_cuda and hasattr(args, "vllm_gpu") else None)
        self.staleness = {}  # {off-policy steps: batches trained so far}, for wandb's histogram
        self.trace = os.path.join(run_dir, "trace.json")
        self.first, self.warned = None, set()  # the first update's metrics; the signs of a collapse said
        self.last_log = None  # when the last update was logged: an update's wall-clock time runs from there
        self.path = os.path.join(run_dir, "metrics.jsonl")
        self.progress = tqdm(total=args.num_updates * args.batch_size, initial=episode, unit="ep",
                             disable=not self.writer)
        if not self.writer:
            return
        os.makedirs(run_dir, exist_ok=True)
        atexit.register(self.write_own_trace)  # a run that ends in an error still shows where its time went
        if args.resume and os.path.exists(self.path):
            with open(self.path) as f:
                kept = [line for line in f if json.loads(line)["update"] <= start_update]
            with open(self.path, "w") as f:
                f.writelines(kept)
        if self.track:
            import wandb

            self.wandb = wandb
            wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_name, id=run_name,
                       config=asdict(args), resume="allow" if args.resume else None, save_code=True)
            # The code snapshot: save_code keeps the script; the modules of its directory that it imported join it
            # (copied into the run's files, which wandb uploads).
            here = os.path.dirname(os.path.abspath(sys.argv[0]))
            os.makedirs(os.path.join(wandb.run.dir, "code"), exist_ok=True)
            for module in list(sys.modules.values()):
                path = os.path.abspath(getattr(module, "__file__", None) or "/")
                if os.path.isfile(path) and os.path.dirname(path) == here and path != os.path.abspath(sys.argv[0]):
                    shutil.copy(path, os.path.join(wandb.run.dir, "code", os.path.basename(path)))

    def log(self, update, metrics, samples=None, phases=None):
        """Record an update: its `metrics` (and evaluation `samples`), and its `phases` on this rank ({name: start
        time}, each to the next's start, the last to now) for the timeline."""
        now = time.time()
        if phases:
            timeline.record_phases(phases, now, update=update)
        if not self.writer:
            return
        if phases:
            metrics = {**metrics, **time_shares(metrics, timeline.EVENTS, self.last_log or min(phases.values()), now)}
            self.last_log = now
        metrics = {**metrics, **throughputs(metrics, self.batch_size, self.world_size)}
        metrics = {**metrics, **per_gpu_throughputs(metrics, self.batch_size, self.gpus)}
        if "policy/entropy_avg" in metrics:  # an update's metrics, not only an evaluation's
            self.first = self.first or (update, metrics)
            for kind, message in collapse_signs(update, metrics, *self.first):
                if kind not in self.warned:  # once a run each: the figure is in metrics.jsonl at every update
                    self.warned.add(kind)
                    tqdm.write(f"warning: update {update}: {message}", file=sys.stderr)
        self.progress.update(metrics["episode"] - self.progress.n)
        if "objective/scores" in metrics:  # (online DPO's KL is its pairs')
            self.progress.set_postfix(score=f"{metrics['objective/scores']:.3f}",
                                      kl=f"{metrics.get('objective/kl', metrics.get('pairs/kl')):.2f}",
                                      eps=f"{metrics['time/episodes_per_second']:.0f}")
        if samples and update:
            scores = ", ".join(f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/"))
            tqdm.write(f"update {update}: {scores}")
            for query, response, score in samples[:2]:
                tqdm.write(f"  {query!r} -> {response!r} (score {score})")
        with open(self.path, "a") as f:
            f.write(json.dumps({"update": update, **metrics}) + "\n")
        if self.track:
            self.wandb.log(metrics, step=metrics["episode"])
            if "async/off_policy_steps" in metrics:
                steps = round(metrics["async/off_policy_steps"])
                self.staleness[steps] = self.staleness.get(steps, 0) + 1
                self.wandb.log({"async/staleness": self.wandb.Histogram(np_histogram=staleness_histogram(
                    self.staleness))}, step=metrics["episode"])
            tokens = {int(key.rsplit("_", 1)[1]): share for key, share in metrics.items()
                      if key.startswith("async/tokens_stale_")}
            if tokens:  # streaming: this batch's tokens by staleness (GeneratedBatch.stream_metrics())
                self.wandb.log({"async/token_staleness": self.wandb.Histogram(np_histogram=staleness_histogram(
                    tokens))}, step=metrics["episode"])
            if samples:
                table = self.wandb.Table(columns=["query", "response", "score"], data=samples)
                self.wandb.log({"eval/samples": table}, step=metrics["episode"])

    def close(self):
        """End the record (every rank calls this): the timeline of every rank into trace.json, after a resumed run's
        earlier one."""
        self.progress.close()
        ranks = [None] * dist.get_world_size() if self.writer else None
        dist.gather_object(timeline.EVENTS, ranks, dst=0)
        if self.writer:
            atexit.unregister(self.write_own_trace)
            write_trace(self.trace, ranks)
        if self.writer and self.track:
            self.wandb.finish()

    def write_own_trace(self):
        """trace.json from rank 0's timeline alone, at the exit of a run that ended before close() (an error, a signal):
        the other ranks may be gone or stuck, so theirs are not gathered."""
        try:  # (best effort: the error that ended the run, a full disk say, has had its one line)
            write_trace(self.trace, [list(timeline.EVENTS)])
        except OSError:
            pass


def throughputs(metrics, batch_size, world_size):
    """An update's speed in tokens per second, from what every script logs: the batch's response tokens (`batch_size`
    responses of val/response_length on average) over the seconds generating them (in a *_vllm.py vLLM's one engine
    generates the whole batch; in the others each of the `world_size` processes its share), and each learner
    process's share of the tokens its loss took over its time/training: val/trained_tokens where the script logs it
    (online DPO's pairs, best-of-k's best, TBA's draw from its buffer), else the batch's. Prompt tokens are not counted
    (no script logs their number)."""
    if "val/response_length" not in metrics:  # an evaluation's row
        return {}
    tokens = batch_size * metrics["val/response_length"]
    generating = metrics.get("time/vllm_generation") or metrics.get("time/generation", 0) * world_size
    speeds = {}
    if generating > 0:
        speeds["time/generated_tokens_per_second"] = tokens / generating
    if metrics.get("time/training", 0) > 0:
        trained = metrics.get("val/trained_tokens", tokens)
        speeds["time/trained_tokens_per_second"] = trained / world_size / metrics["time/training"]
    return speeds


def run_gpus(world_size, on_cuda, vllm_placement=None):
    """The GPUs a run uses: one for each learner process, and vLLM's where it has one of its own (`vllm_placement`,
    distributed.vllm_gpu's (its GPU, the training GPU it shares or None), in a *_vllm.py); 0 on a CPU."""
    if not on_cuda:
        return 0
    return world_size + (vllm_placement is not None and vllm_placement[1] is None)


def per_gpu_throughputs(metrics, batch_size, gpus):
    """An update's tokens per second per GPU of the run, as peers report throughput (verl's perf/throughput): the
    batch's response tokens, generated and trained (val/trained_tokens where logged), over the update's wall-clock
    seconds (time/update) times the run's `gpus`, each GPU counted busy or idle. Unlike throughputs()' rates, which
    time a process's own generating or training, this one falls when a GPU waits. None on a CPU (`gpus` 0)."""
    if not gpus or "val/response_length" not in metrics or metrics.get("time/update", 0) <= 0:
        return {}
    generated = batch_size * metrics["val/response_length"]
    gpu_seconds = metrics["time/update"] * gpus
    return {"time/generated_tokens_per_second_per_gpu": generated / gpu_seconds,
            "time/trained_tokens_per_second_per_gpu": metrics.get("val/trained_tokens", generated) / gpu_seconds}


def staleness_histogram(counts):
    """(batches, bin edges) for wandb.Histogram of {off-policy steps: batches}: one bin for each whole number of steps
    from 0 to the most seen, centred on it."""
    most = max(counts)
    return [counts.get(steps, 0) for steps in range(most + 1)], [steps - 0.5 for steps in range(most + 2)]


def collapse_signs(update, metrics, first_update, first):
    """The signs of a collapsing policy in an update's `metrics`, against those of the run's first logged update, as
    (kind, message): responses of at most one token on average (every one empty), the learner's mean entropy more
    than twice the first update's, a KL to the reference above 3 nats a token. A run goes on; its log says so. (The
    README's LoRA command at --learning-rate 3e-3 crossed both at updates 11-12 and sampled only the stop token from
    update 19; at 1e-3 the entropy stayed within 1.25 times and the KL within 1.6 nats a token over 1,000 updates:
    benchmark/results/readme_lora_tiny.txt.)"""
    length, entropy = metrics["val/response_length"], metrics["policy/entropy_avg"]
    kl = metrics.get("objective/kl", metrics.get("pairs/kl"))
    signs = []
    if length <= 1:
        signs.append(("empty", f"the responses are {length:.2f} tokens long on average (val/response_length): the "
                               "policy has collapsed to empty responses (a learning rate too high?)"))
    if entropy > 2 * first["policy/entropy_avg"] > 0:
        signs.append(("entropy", f"policy/entropy_avg {entropy:.3f} is more than twice update {first_update}'s "
                                 f"{first['policy/entropy_avg']:.3f}: the policy may be collapsing (a learning rate "
                                 "too high?)"))
    if kl is not None and length > 0 and kl / length > 3:
        signs.append(("kl", f"the KL to the reference is {kl / length:.2f} nats a token ({kl:.2f} a response): the "
                            "policy has run far from it (a learning rate too high, or a KL coefficient too low?)"))
    return signs


def write_trace(path, ranks):
    """trace.json, in Chrome's trace format: each rank a process, each of its threads (the learner's, the generator's)
    a track of its own; the events of a trace already there (the run before a resume) kept first."""
    events = []
    if os.path.exists(path):
        with open(path) as f:
            events = [event for event in json.load(f)["traceEvents"] if event["ph"] == "X"]
    threads = {}  # (rank, thread name): track, the learner's first and the generator's second in every trace
    for rank, recorded in enumerate(ranks):
        for event in recorded:
            order = {"MainThread": 0, "generator": 1}
            tid = threads.setdefault((rank, event["tid"]), order.get(event["tid"], len(order) + len(threads)))
            events.append({**event, "pid": rank, "tid": tid})
    names = [{"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}}
             for rank in range(len(ranks))]
    names += [{"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": name}}
              for (rank, name), tid in threads.items()]
    with open(path + ".tmp", "w") as f:
        json.dump({"traceEvents": names + events, "displayTimeUnit": "ms"}, f)
    os.replace(path + ".tmp", path)


# the generator thread's busy phases (streaming: "generate", its time with requests in flight)
VLLM_WORK = ("generate a batch", "generate", "load a version", "check the weights")


def time_shares(metrics, events, start, end):
    """Where an update's wall-clock time (`start` to `end`: from the last update's log) went: its seconds and, in a
    *_vllm.py, the learner's idle share (waiting for the batch), vLLM's (its generator thread's phases of VLLM_WORK
    in this process's timeline `events`, which end in order) and the overlap bound, (generation + the learner's work) /
    their maximum: the speed-up over --sync that generating wholly beside training would give."""
    seconds = end - start
    shares = {"time/update": seconds}
    if "time/vllm_generation" not in metrics or seconds <= 0:
        return shares
    busy = 0.0
    for event in reversed(events):
        event_start, event_end = event["ts"] / 1e6, (event["ts"] + event["dur"]) / 1e6
        if event_end <= start:
            break
        if event["tid"] == "generator" and event["name"] in VLLM_WORK:
            busy += max(0.0, min(end, event_end) - max(start, event_start))
    generation, learner = metrics["time/vllm_generation"], seconds - metrics["time/generation_wait"]
    return {**shares, "time/learner_idle_fraction": metrics["time/generation_wait"] / seconds,
            "time/vllm_idle_fraction": 1 - busy / seconds,
            "time/overlap_bound": (generation + learner) / max(generation, learner, 1e-9)}

