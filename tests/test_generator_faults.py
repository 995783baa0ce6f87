"""A generator that failed while the learner trained is found wherever the learner next waits on it: at the next batch,
and also while a checkpoint keeps the batches generated ahead or an in-memory hand-off waits for vLLM. Each ends the
run in the one `error:` line that names the failure, the update and the checkpoint to resume from."""

import json
import os
import types

import pytest
from conftest import ROOT, read_metrics, run_dir_of, run_script

import generator
import online_dpo_vllm


def failed_generation(tmp_path, in_memory):
    """rank 0's AsyncGeneration at update 3 of a run whose GenerationThread recorded an error (vLLM's engine alive)."""
    args = online_dpo_vllm.Args(generation_timeout=5, bf16=False, check_weights_every=0)
    args.num_updates = 10
    engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=types.SimpleNamespace(
        resources=types.SimpleNamespace(engine_dead=False))))
    thread = generator.GenerationThread(args, engine, online_dpo_vllm.sampling_params, online_dpo_vllm.generating_version,
                                        online_dpo_vllm.batch_prompts,
                                        weights_dir=str(tmp_path / "weights"), train_prompts=[[1]], prompts_per_rank=1,
                                        k=2, stop_id=0, first_version=0, off_policy_steps=1, probe=None,
                                        in_memory=in_memory)
    thread.error = RuntimeError("CUDA out of memory in generate")  # as _run records it
    generation = generator.AsyncGeneration.__new__(generator.AsyncGeneration)
    generation.args, generation.rank, generation.thread, generation.run_dir = args, 0, thread, str(tmp_path)
    generation.update, generation.first_version, generation.off_policy_steps = 3, 0, 1
    generation.schedule, generation.in_memory, generation.transfer = online_dpo_vllm.generating_version, in_memory, None
    generation.streaming = False
    return generation


@pytest.mark.parametrize("where", ["checkpoint", "hand-off"])
def test_a_generator_failure_found_at_a_checkpoint_or_hand_off_ends_in_one_line(tmp_path, capsys, where):
    generation = failed_generation(tmp_path, in_memory=where == "hand-off")
    with pytest.raises(SystemExit) as exit:
        if where == "checkpoint":
            generation.checkpoint_files(3)
        else:
            generation.hand_over(policy=None, update=3)
    error = capsys.readouterr().err
    assert exit.value.code == 1 and error.count("\n") == 1, error
    assert error == ("error: the generator failed: RuntimeError('CUDA out of memory in generate') (update 3); no "
                     "checkpoint was written yet (--save-every saves more often)\n"), error


def test_a_prompt_filter_in_the_scripts_batch_prompts_reaches_vllm_and_step_1_alike(tmp_path):
    """R1 of the sixth reading: the prompts were chosen twice (step 1 and the generator), so a curriculum written in
    step 1 paired vLLM's responses with other prompts. Now the script chooses once (batch_prompts) and the batch
    carries the indices: a copy of rloo_vllm.py whose batch_prompts keeps only the first 40 train prompts trains on
    exactly those, and vLLM's log-probabilities of each response are the learner's under the same prompt (--sync,
    float32: a response paired with another prompt would differ by far more)."""
    copy = os.path.join(ROOT, f"curriculum_rloo_vllm_{os.getpid()}.py")
    with open(os.path.join(ROOT, "rloo_vllm.py")) as f:
        source = f.read()
    choice = "    return [prompt_batch(num_prompts, prompts_per_rank, batch - 1, args.seed, rank, args.world_size)"
    step_1 = "        indices = batch.prompts[rank]"
    assert source.count(choice) == 1 and source.count(step_1) == 1
    trained = tmp_path / "trained.jsonl"
    source = source.replace(choice, choice.replace("num_prompts,", "min(num_prompts, 40),"))
    source = source.replace(step_1, f"{step_1}\n        open({str(trained)!r}, 'a').write(__import__('json').dumps(indices) + '\\n')")
    with open(copy, "w") as f:
        f.write(source)
    try:
        run_script(os.path.basename(copy), "--sync", "--total-episodes", "192", "--eval-every", "0",
                   "--num-eval-prompts", "8", "--vllm-enforce-eager", "--output-dir", str(tmp_path / "run"))
    finally:
        os.remove(copy)
    batches = [json.loads(line) for line in open(trained)]
    assert len(batches) == 3 and all(len(indices) == 32 and max(indices) < 40 for indices in batches), batches
    assert batches[0] != batches[1]  # a batch an epoch of the 40, each shuffled
    mismatch = [row["async/mismatch_kl"] for row in read_metrics(run_dir_of(str(tmp_path / "run"))) if row["update"]]
    assert len(mismatch) == 3 and max(mismatch) < 1e-4, mismatch
