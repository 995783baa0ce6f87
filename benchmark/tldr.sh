#!/usr/bin/env bash
# The paper's TL;DR experiments (Noukhovitch et al. 2025, section 3-4), one command per run, then
# the paper's evaluation of every checkpoint with evaluate.py.
#
#   bash benchmark/tldr.sh <algorithm> <size> <mode>     # runs one experiment, then evaluates it
#   bash benchmark/tldr.sh --print <algorithm> <size> <mode>   # only prints the commands
#
#   algorithm: online_dpo | ppo | rloo | bok
#   size:      410m | 1b | 2.8b
#   mode:      sync  (4 training GPUs; generation on them, HF generate)
#              async (online_dpo only: 3 training GPUs + vLLM on the 4th, 1 update off-policy)
#
# Meant for one node with 4 NVIDIA A100 80GB (the paper's hardware), CUDA, `pip install -r
# requirements.txt`, a Hugging Face hub connection, and `wandb login`. It has NOT been run by this
# project: the machine it was written on has no GPU and no hub access.
#
# Settings, as in the paper and its code (github.com/mnoukhov/async_rlhf, configs/*_tldr*.yml):
# SFT mnoukhov/pythia{size}-sft-tldr, reward model mnoukhov/pythia{size}-rm-tldr6.9b, gold reward
# model cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr (evaluation only), learning rate 3e-6
# (linear decay), 512 episodes per batch, 131072 episodes, temperature 0.7, KL coefficient 0.05,
# DPO beta 0.1, missing-EOS penalty -1, responses of 53 tokens, prompts of up to 512, one epoch,
# bf16.
#
# Batch units. Our scripts count sampled responses. The paper's RLOO, best-of-2 and PPO code counts
# them too (PPO samples one response per prompt), but its online DPO counts prompts, each sampled
# twice: its "512 episodes" are 512 pairs. To run the same online DPO, its commands below sample
# 1024 responses per batch and 262144 in all (the same 256 updates).
# Async with 3 training ranks: 1024 is not a multiple of 3 x 32, so a batch there is
# 3 x 32 x 11 = 1056 responses (528 pairs, 3 % more than sync) over the same 256 updates.
set -euo pipefail
cd "$(dirname "$0")/.."

print_only=0
if [ "${1:-}" = "--print" ]; then print_only=1; shift; fi
if [ $# -ne 3 ]; then sed -n '2,16p' "$0"; exit 2; fi
algorithm=$1 size=$2 mode=$3

case $size in
  410m|1b) zero=ds_configs/zero2.json ;;
  2.8b) zero=ds_configs/zero3.json ;;
  *) echo "error: size must be 410m, 1b or 2.8b, got $size" >&2; exit 2 ;;
esac
data=vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144
gold=cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr
out=runs/tldr/${algorithm}_${size}_${mode}
common=(--sft-model-path "mnoukhov/pythia${size}-sft-tldr" --reward-model-path "mnoukhov/pythia${size}-rm-tldr6.9b"
        --gold-reward-model-path None --dataset-name "$data" --dataset-train-split train
        --dataset-eval-split validation --max-prompt-length 512 --response-length 53 --temperature 0.7
        --missing-eos-penalty -1.0 --learning-rate 3e-6 --num-ppo-epochs 1 --num-mini-batches 1
        --deepspeed-config "$zero" --eval-every 16 --num-eval-prompts 512 --save-every 64
        --track --wandb-project-name async-rlhf-tldr --exp-name "${algorithm}_${size}_${mode}" --output-dir "$out")

# 4 GPUs x per-device 16 responses x gradient accumulation = responses per batch.
case $algorithm/$mode in
  rloo/sync) train=(deepspeed --num_gpus 4 rloo.py --k 2 --kl-coef 0.05 --per-device-train-batch-size 16
                    --gradient-accumulation-steps 8 --total-episodes 131072) ;;
  bok/sync) train=(deepspeed --num_gpus 4 bok.py --k 2 --per-device-train-batch-size 16
                   --gradient-accumulation-steps 8 --total-episodes 131072) ;;
  ppo/sync) train=(deepspeed --num_gpus 4 ppo.py --kl-coef 0.05 --gamma 1.0 --lam 0.95 --vf-coef 0.1
                   --cliprange 0.2 --cliprange-value 0.2 --per-device-train-batch-size 16
                   --gradient-accumulation-steps 8 --total-episodes 131072) ;;
  online_dpo/sync) train=(deepspeed --num_gpus 4 online_dpo.py --k 2 --beta 0.1 --loss-type sigmoid
                          --per-device-train-batch-size 32 --gradient-accumulation-steps 8 --total-episodes 262144) ;;
  online_dpo/async) train=(deepspeed --num_gpus 3 online_dpo_vllm.py --k 2 --beta 0.1 --loss-type sigmoid
                           --off-policy-steps 1 --vllm-gpu 3 --vllm-gpu-memory-utilization 0.9
                           --per-device-train-batch-size 32 --gradient-accumulation-steps 11
                           --total-episodes 270336) ;;
  */async) echo "error: only online_dpo has an asynchronous script (online_dpo_vllm.py)" >&2; exit 2 ;;
  *) echo "error: algorithm must be online_dpo, ppo, rloo or bok, got $algorithm" >&2; exit 2 ;;
esac

evaluate=(python evaluate.py --checkpoints "$out/RUN" --sft-model-path "mnoukhov/pythia${size}-sft-tldr"
          --gold-reward-model-path "$gold" --dataset-name "$data" --dataset-eval-split validation
          --max-prompt-length 512 --response-length 53 --vllm-gpu 1 --track --wandb-project-name async-rlhf-tldr)

echo "${train[*]} ${common[*]}"
echo "${evaluate[*]}   # RUN: the run directory the first command created"
[ $print_only = 1 ] && exit 0
"${train[@]}" "${common[@]}"
run=$(ls -td "$out"/*__* | head -n 1)
"${evaluate[@]/$out\/RUN/$run}"
