"""The learner's weight source (weight_handoff.PolicyWeights) against the trainer-side weight transfer engines of
both vLLM releases the scripts follow (vllm_engine.VLLM_RELEASES): 0.32's, installed here, and 0.33's own, whose weight
source contract changed (metadata a cached property, iter_full(), implements_iter_full(), owned_names(rank)). vLLM
0.33 has no CPU build yet: its weight_transfer package comes from its wheel and goes before the installed one, with
the rest of vLLM 0.32's. Its engines set up and drive the source as on a GPU, up to what needs one (NCCL's
rendezvous with vLLM's worker, CUDA IPC's export)."""

import glob
import importlib.util
import os
import sys
import zipfile

import pytest
from conftest import ROOT, TINY, run

pytestmark = pytest.mark.slow  # downloads vLLM 0.33's wheel (336 MB), starts Python with vLLM: a minute

CHECK = """
import os, sys
if sys.argv[1]:  # vLLM 0.33's weight_transfer package, before the installed one (0.32)
    import vllm.distributed
    vllm.distributed.__path__.insert(0, sys.argv[1])
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer import base, ipc_engine, nccl_engine
from weight_handoff import PolicyWeights

print("engines from", os.path.dirname(nccl_engine.__file__))
print("0.33's contract:", hasattr(base.WeightSource, "iter_full"))
model = AutoModelForCausalLM.from_pretrained(sys.argv[2])
names = [name for name, _ in model.named_parameters(remove_duplicate=False)]


class Client:  # vLLM's weight-sync client: what the engines ask of vLLM's worker, recorded
    calls = []

    def __getattr__(self, name):
        return lambda *args: Client.calls.append(name)


source = PolicyWeights(model)
assert [m.name for m in source.metadata] == [m.name for m in source.metadata()] == names

# NCCL: a rank that does not send (rank 1 of 2, no rendezvous) iterates as the engine drives it (ZeRO-3's gathers);
# the sender's own iteration, checked against the metadata by the engine, yields every tensor in order.
engine = nccl_engine.NCCLTrainerWeightTransferEngine.trainer_init(
    nccl_engine.NCCLTrainerInitInfo("127.0.0.1", 1, 2, rank=1), client=Client(), source=source)
engine.send_weights()
engine.send_weights()
assert [name for name, _ in engine._checked_iter(source, list(source.metadata))] == names


class CpuIPC(ipc_engine.IPCTrainerWeightTransferEngine):  # its own set-up reads the GPU's UUID: none here
    def __init__(self, *, client, source, is_sender=True, **_):
        base.TrainerWeightTransferEngine.__init__(self, client=client, source=source, is_sender=is_sender)


# CUDA IPC: every rank exports every parameter (0.33 checks the source says so); rank 0 tells vLLM's worker.
CpuIPC.trainer_init(ipc_engine.IPCTrainerInitInfo(rank=0, packed=True), client=Client(), source=source)
assert Client.calls == ["init_weight_transfer_engine"], Client.calls
print("ok")
"""


@pytest.fixture(scope="module")
def vllm_033(tmp_path_factory):
    """vLLM 0.33.0's vllm/distributed/weight_transfer, from its wheel; returns the vllm/distributed above it."""
    out = tmp_path_factory.mktemp("vllm_033")
    run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "vllm==0.33.0", "-d", str(out)], timeout=900)
    (wheel,) = glob.glob(str(out / "vllm-0.33.0-*.whl"))
    with zipfile.ZipFile(wheel) as z:
        z.extractall(out, [n for n in z.namelist() if n.startswith("vllm/distributed/weight_transfer/")])
    os.remove(wheel)
    return str(out / "vllm" / "distributed")


@pytest.mark.parametrize("release", ["0.32", "0.33"])
def test_the_learners_weight_source_follows_each_vllm_releases_contract(request, release):
    distributed = request.getfixturevalue("vllm_033") if release == "0.33" else ""
    result = run([sys.executable, "-c", CHECK, distributed, os.path.join(TINY, "sft")],
                 env={"PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")])})
    assert result.stdout.strip().endswith("ok"), result.stdout
    installed = os.path.join(os.path.dirname(importlib.util.find_spec("vllm").origin), "distributed")
    assert f"engines from {os.path.join(distributed or installed, 'weight_transfer')}" in result.stdout, result.stdout
    assert f"0.33's contract: {release == '0.33'}" in result.stdout
