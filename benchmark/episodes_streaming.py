"""Streaming against batch-mode generation of multi-turn episodes: the generator alone, as where generation bounds an
update (a GPU learner), which this machine's learner never lets it be.

grpo_tools_vllm.py's episodes (its calculator environment, at most --max-turns turns) for --batches batches of --prompts
prompts x --k episodes, from one policy version (no hand-off: the staleness bound never binds), one vLLM engine for
both modes, each mode's own generator thread as the script runs it:
- batch mode (generator.GenerationThread with the script's rollout()): a batch's live episodes take each turn together,
  so every turn waits for the slowest of the one before, and the next batch starts when the last episode ends;
- streaming (generator.StreamingThread with the script's environment_step()): an episode's next turn goes to vLLM as
  its last ends, and a new prompt's group as a group finishes (at most a batch's requests in flight).
The modes run alternately, --repeats times each. Printed per run: seconds to the last batch, episodes and policy tokens
per second, vLLM's mean requests per decoding step, turns and tool calls per episode.

    python benchmark/episodes_streaming.py --task tiny
    python benchmark/episodes_streaming.py --task smollm2
"""

import argparse
import functools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import data  # noqa: E402
import generator  # noqa: E402
import grpo_tools_vllm  # noqa: E402
import vllm_engine  # noqa: E402

TASKS = {  # grpo_tools_vllm.py's arguments for each task
    "tiny": dict(),  # its defaults: the tiny tool task and its SFT policy, <calc>...</calc>
    "smollm2": dict(sft_model_path="assets/smollm2/model", dataset_name="assets/smollm2/data", tool_call="+{} =",
                    tool_result=" {}.", max_prompt_length=64),  # SmolLM2 as it ships, a call format it writes untaught
}


def run_mode(mode, args, llm, env, train_prompts, stop_id):
    """All of args.num_updates batches from one mode's generator thread: (seconds, the batches, decoding steps, the
    requests in flight summed over them)."""
    counted = {"steps": 0, "in_flight": 0}
    engine_step = llm.llm_engine.step

    def step():  # (counting vLLM's decoding steps and the requests each ran)
        counted["steps"] += 1
        counted["in_flight"] += llm.llm_engine.get_num_unfinished_requests()
        return engine_step()

    llm.llm_engine.step = step
    thread_class = generator.StreamingThread if mode == "streaming" else generator.GenerationThread
    extra = {"environment": functools.partial(grpo_tools_vllm.environment_step, env)} if mode == "streaming" else {}
    thread = thread_class(args, llm, functools.partial(grpo_tools_vllm.turn_request, env),
                          grpo_tools_vllm.generating_version, grpo_tools_vllm.batch_prompts,
                          weights_dir=tempfile.mkdtemp(), train_prompts=train_prompts,
                          prompts_per_rank=args.local_batch_size // args.k, k=args.k, stop_id=stop_id,
                          first_version=0, off_policy_steps=args.num_updates, probe=None, in_memory=False,
                          rollout=functools.partial(grpo_tools_vllm.rollout, env, args), **extra)
    started = time.time()
    thread.start()
    batches = [thread.get() for _ in range(args.num_updates)]
    seconds = time.time() - started
    thread.stopping.set()
    thread.thread.join()
    llm.llm_engine.step = engine_step
    return seconds, batches, counted["steps"], counted["in_flight"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="tiny")
    parser.add_argument("--batches", type=int, default=4, help="batches each run generates")
    parser.add_argument("--prompts", type=int, default=16, help="prompts a batch")
    parser.add_argument("--k", type=int, default=4, help="episodes a prompt")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument("--response-length", type=int, default=64, help="tokens an episode may hold, all turns")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each mode, alternately")
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    args = grpo_tools_vllm.Args(**TASKS[options.task], k=options.k, max_turns=options.max_turns, seed=options.seed,
                                response_length=options.response_length, bf16=False, temperature=1.0,
                                per_device_train_batch_size=options.prompts * options.k, vllm_enforce_eager=True,
                                total_episodes=options.batches * options.prompts * options.k,
                                sync=True)  # (no learner beside vLLM: it may use every core, as with --sync)
    args.world_size = 1
    grpo_tools_vllm.validate(args)  # (batch sizes and the number of updates, as the script computes them)
    tokenizer, stop_id, train_prompts, *_ = data.load_data(args, args.local_batch_size // args.k)
    env = grpo_tools_vllm.make_calculator(args, tokenizer, stop_id)
    llm = vllm_engine.start_vllm(args, args.sft_model_path)
    print(f"task {options.task}: {options.batches} batches of {options.prompts} prompts x {options.k} episodes, at most "
          f"{options.max_turns} turns and {options.response_length} tokens each, one vLLM engine, seed {options.seed}", flush=True)
    try:
        for repeat in range(options.repeats):
            for mode in ("batch", "streaming"):
                seconds, batches, steps, in_flight = run_mode(mode, args, llm, env, train_prompts, stop_id)
                episodes = [(ids, own) for batch in batches for ids, own in zip(batch.responses[0], batch.sampled[0])]
                policy_tokens = sum(sum(own) for _, own in episodes)
                turns = sum(sum(1 for i, s in enumerate(own) if s and (i == 0 or not own[i - 1]))
                            for _, own in episodes)  # (a turn: a run of sampled tokens)
                calls = sum(ids[i] == env.call_end_id for ids, own in episodes for i in range(len(ids)) if own[i])
                print(f"{mode:9s} run {repeat + 1}: {seconds:6.1f} s, {len(episodes) / seconds:6.2f} episodes/s, "
                      f"{policy_tokens / seconds:7.1f} policy tokens/s, {steps} decoding steps, "
                      f"{in_flight / steps:5.1f} requests a step, {turns / len(episodes):.2f} turns and "
                      f"{calls / len(episodes):.2f} calls an episode, {policy_tokens / len(episodes):.1f} policy tokens "
                      f"an episode", flush=True)
    finally:
        vllm_engine.shut_down(llm)


if __name__ == "__main__":
    main()
