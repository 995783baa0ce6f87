"""A vLLM plugin for the tests: the scripts' in-memory weight hand-off (--weight-sync memory) on a CPU.

On a GPU of its own vLLM takes the learner's weights through its NCCL weight transfer engines; a CPU has no NCCL.
On a machine without CUDA this plugin puts, under vLLM's name "nccl" (in both of its registries: the worker's and
the trainer's), the same engines with a gloo process group in place of NCCL's communicator: the same calls,
metadata and layer-wise reload, so that CI drives the scripts' NCCL branch and the whole in-memory control path
(VllmClient, hand_off_watchdog, the generator's wait for the receiver) on a CPU. One difference: the trainer's
send_weights returns once the bytes have gone, and finish() (the generator's, before its next batch) waits for
vLLM's worker to load them and ends the update: on a CPU that load re-packs every layer (1.5-2 s a GB).

vLLM loads the plugin in every process it runs (this one when an engine is created, its engine core, its worker)
through the `vllm.general_plugins` entry point in the `*.dist-info` beside this file: tests/conftest.py puts this
directory on PYTHONPATH, and benchmark/weight_sync.py does the same. The tensors' bytes go in buckets of about
64 MiB, cut where the metadata says on both sides; one bucket travels while the trainer packs the next, and the
worker receives them all before loading any, into buffers it keeps (new memory is slow to touch).
"""

import concurrent.futures
import datetime
import math
import threading

import torch
import torch.distributed as dist
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine, NCCLWeightTransferEngine

BUCKET_BYTES = 64 * 2**20
TIMEOUT = datetime.timedelta(seconds=3600)  # a stuck broadcast is ended sooner by the scripts' hand_off_watchdog()


def register():
    """vLLM's entry point: on a machine without CUDA, the gloo engines take vLLM's "nccl" name on both sides."""
    if torch.cuda.is_available():
        return
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    WeightTransferEngineFactory._registry["nccl"] = lambda: GlooWeightTransferEngine  # vLLM's own are lazily imported
    WeightTransferTrainerFactory._registry["nccl"] = lambda: GlooTrainerWeightTransferEngine


def connect(store, rank):
    """The trainer (rank 0, which opened the store) and vLLM's worker (rank 1) in a gloo group of two."""
    return dist.ProcessGroupGloo(dist.PrefixStore("weights", store), rank, 2, TIMEOUT)


def buckets(sizes):
    """Indices of the tensors in each bucket: consecutive tensors until one brings the bucket to BUCKET_BYTES."""
    bucket, size = [], 0
    for i, nbytes in enumerate(sizes):
        bucket.append(i)
        size += nbytes
        if size >= BUCKET_BYTES or i == len(sizes) - 1:
            yield bucket
            bucket, size = [], 0


def in_thread(function, *args):
    """function(*args) in a daemon thread (a call stuck in a dead engine never blocks the exit); its Future."""
    done = concurrent.futures.Future()

    def run():
        try:
            done.set_result(function(*args))
        except BaseException as error:
            done.set_exception(error)

    threading.Thread(target=run, daemon=True).start()
    return done


class GlooWeightTransferEngine(NCCLWeightTransferEngine):
    """vLLM's worker side."""

    def init_transfer_engine(self, init_info):
        store = dist.TCPStore(init_info.master_address, init_info.master_port, 2, is_master=False, timeout=TIMEOUT)
        self.model_update_group = connect(store, 1)
        self.buffers = []  # kept for the next update

    def update_weights(self, update_info):  # vLLM's synchronizes the accelerator after, which a CPU torch refuses
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info):
        tensors = [(name, getattr(torch, dtype), shape) for name, dtype, shape in
                   zip(update_info.names, update_info.dtype_names, update_info.shapes)]
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in tensors]
        received = []
        for n, bucket in enumerate(buckets(sizes)):
            if len(self.buffers) == n:
                self.buffers.append(torch.empty(sum(sizes[i] for i in bucket), dtype=torch.uint8))
            buffer = self.buffers[n]
            received.append((self.model_update_group.broadcast(buffer, 0), buffer, bucket))
        for work, _, _ in received:  # all bytes first: the learner is free as soon as they are here
            work.wait()
        for _, buffer, bucket in received:
            weights, offset = [], 0
            for i in bucket:
                name, dtype, shape = tensors[i]
                weights.append((name, buffer[offset: offset + sizes[i]].view(dtype).view(shape)))
                offset += sizes[i]
            self.model.load_weights(weights)

    def shutdown(self):
        self.model_update_group = None

class GlooTrainerWeightTransferEngine(NCCLTrainerWeightTransferEngine):
    """The learner's side: takes the scripts' NCCLTrainerInitInfo."""

    @classmethod
    def trainer_init(cls, init_info, *, client, source=None):
        engine = cls(client=client, source=source, is_sender=init_info.is_sender, packed=False)
        engine.slots = [torch.empty(0, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]
        if engine.is_sender:  # vLLM's worker joins the group while this process opens it
            # on a port the store takes itself: the one the scripts chose (master_port) may be taken since
            store = dist.TCPStore(init_info.master_address, 0, 2, is_master=True, wait_for_workers=False,
                                  timeout=TIMEOUT)
            joined = in_thread(client.init_weight_transfer_engine, {
                "master_address": init_info.master_address, "master_port": store.port, "rank_offset": 1,
                "world_size": 2})
            engine.model_update_group = connect(store, 0)
            joined.result()
        return engine

    def send_weights(self):
        # vLLM 0.32's weight sources: metadata() and iteration; 0.33's: the metadata property and iter_full()
        meta = list(self.source.metadata() if callable(self.source.metadata) else self.source.metadata)
        if not self.is_sender:
            for _ in (self.source.iter_full() if hasattr(self.source, "iter_full") else self.source):
                pass  # the other ranks take part in ZeRO-3's gathers
            return
        self.client.start_weight_update()
        # As vLLM's NCCL sender: the worker's update_weights runs in an executor's thread, which Python joins at exit
        executor = concurrent.futures.ThreadPoolExecutor(1)
        self.receiving = executor.submit(self.client.update_weights, {
            "names": [m.name for m in meta], "dtype_names": [str(m.dtype).split(".")[-1] for m in meta],
            "shapes": [list(m.shape) for m in meta]})
        executor.shutdown(wait=False)
        tensors = self._checked_iter(self.source, meta)
        sending = None
        for bucket in buckets([math.prod(m.shape) * m.dtype.itemsize for m in meta]):
            parts = [next(tensors)[1].contiguous().view(-1).view(torch.uint8) for _ in bucket]
            size = sum(part.numel() for part in parts)
            self.slots.reverse()  # packed into one of two buffers while the other is being sent
            if self.slots[0].numel() < size:
                self.slots[0] = torch.empty(size, dtype=torch.uint8)
            packed = torch.cat(parts, out=self.slots[0][:size])
            if sending is not None:
                sending.wait()
            sending = self.model_update_group.broadcast(packed, 0)
        sending.wait()
        if next(tensors, None) is not None:  # (which also ends the last module's ZeRO-3 gather: see PolicyWeights)
            raise RuntimeError("the weights yielded more tensors than their metadata declared")

    def finish(self):
        self.receiving.result()
        self.client.finish_weight_update()

    def shutdown(self):
        self.model_update_group = None
