"""The run's timeline: each process's phases (the learner's steps of every update, the generator thread's waits, loads
and batches, each checkpoint) as Chrome trace events, which runlog.RunLog writes with every rank's into trace.json in
the run directory (open it in Perfetto, ui.perfetto.dev, or chrome://tracing). About 1 KB an update: on always.
Nothing here changes what is learned."""

import contextlib
import threading
import time

EVENTS = []  # this process's, in the order they ended (appending is atomic: the generator thread records too)


def record(name, start, end, **args):
    """A phase `name` of this thread from `start` to `end` (time.time() seconds), with `args` shown beside it."""
    EVENTS.append({"name": name, "ph": "X", "ts": round(start * 1e6), "dur": round((end - start) * 1e6),
                   "tid": threading.current_thread().name, "args": args})


def record_phases(boundaries, end, **args):
    """Consecutive phases of this thread: {name: start}, each to the next one's start, the last to `end`."""
    starts = list(boundaries.items())
    for (name, start), (_, stop) in zip(starts, starts[1:] + [(None, end)]):
        record(name, start, stop, **args)


@contextlib.contextmanager
def span(name, **args):
    """A phase of this thread: the time the `with` block takes."""
    start = time.time()
    try:
        yield
    finally:
        record(name, start, time.time(), **args)
