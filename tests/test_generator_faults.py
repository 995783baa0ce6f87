"""A generator that failed while the learner trained is found wherever the learner next waits on it: at the next batch,
and also while a checkpoint keeps the batches generated ahead or an in-memory hand-off waits for vLLM. Each ends the
run in the one `error:` line that names the failure, the update and the checkpoint to resume from."""

import types

import pytest

import generator
import online_dpo_vllm


def failed_generation(tmp_path, in_memory):
    """rank 0's AsyncGeneration at update 3 of a run whose GenerationThread recorded an error (vLLM's engine alive)."""
    args = online_dpo_vllm.Args(generation_timeout=5, bf16=False, check_weights_every=0)
    args.num_updates = 10
    engine = types.SimpleNamespace(llm_engine=types.SimpleNamespace(engine_core=types.SimpleNamespace(
        resources=types.SimpleNamespace(engine_dead=False))))
    thread = generator.GenerationThread(args, engine, online_dpo_vllm.vllm_generate, online_dpo_vllm.generating_version,
                                        weights_dir=str(tmp_path / "weights"), train_prompts=[[1]], prompts_per_rank=1,
                                        k=2, stop_id=0, first_version=0, off_policy_steps=1, probe=None,
                                        in_memory=in_memory)
    thread.error = RuntimeError("CUDA out of memory in generate")  # as _run records it
    generation = generator.AsyncGeneration.__new__(generator.AsyncGeneration)
    generation.args, generation.rank, generation.thread, generation.run_dir = args, 0, thread, str(tmp_path)
    generation.update, generation.first_version, generation.off_policy_steps = 3, 0, 1
    generation.schedule, generation.in_memory, generation.transfer = online_dpo_vllm.generating_version, in_memory, None
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
