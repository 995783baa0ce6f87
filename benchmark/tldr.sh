#!/usr/bin/env bash
# The paper's TL;DR experiments (Noukhovitch et al. 2025, sections 3-4), one command per run, then
# the paper's evaluation of every checkpoint with evaluate.py.
#
#   bash benchmark/tldr.sh <algorithm> <size> <mode>          # runs one experiment, then evaluates it
#   bash benchmark/tldr.sh --print <algorithm> <size> <mode>  # only prints the two commands
#
#   algorithm: online_dpo | ppo | rloo | bok
#   size:      410m | 1b | 2.8b
#   mode:      async (online_dpo: 3 training GPUs + vLLM on the 4th, one update off-policy)
#              sync  (online_dpo: the same 3+1 layout with --sync: the baseline of the paper's speed-up)
#              hf    (4 training GPUs generating with HF, the paper code's synchronous 4-GPU configs)
#
# Meant for one node with 4 NVIDIA A100 80GB (the paper's hardware), CUDA, `pip install -r
# requirements.txt`, a Hugging Face hub connection, and `wandb login`. It has NOT been run by this
# project: the machine it was written on has no GPU and no hub access. tests/test_tldr.py checks
# the printed commands against the paper's settings.
#
# Settings, as in the paper's code (github.com/mnoukhov/async_rlhf, configs/*_tldr*.yml and the
# defaults of the TRL 0.9.4 it builds on): SFT mnoukhov/pythia{size}-sft-tldr, reward model
# mnoukhov/pythia{size}-rm-tldr6.9b, learning rate 3e-6 (linear decay), temperature 0.7, KL
# coefficient 0.05 (RLOO, PPO), DPO beta 0.1, responses of 53 tokens, prompts of up to 512, one
# epoch, one mini-batch, DeepSpeed ZeRO-2 at every size, bf16. A response without EOS gets the
# score -1 in place of its reward-model score (--missing-eos-mode replace; TRL adds instead).
# Evaluation: the gold reward model cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr (its
# tokenizer lacks the SFT model's pad token: evaluate.py scores the re-tokenised text), responses
# of up to 128 tokens at temperature 0.01, win rate against the dataset's references.
#
# Batch units. Our scripts count sampled responses. The paper's online DPO counts prompts, each
# sampled twice, so its batches of P prompts are 2P responses here:
#   async, sync: 504 prompts a batch (3 GPUs x pairs per device x accumulation: 3 x 21 x 8 for 410m,
#                3 x 8 x 21 for 1b, 3 x 6 x 28 for 2.8b), 129,024 prompts = 256 updates;
#   hf:          512 prompts a batch (4 x 32 x 4, 4 x 16 x 8, 4 x 4 x 32), 131,072 prompts = 256 updates.
# Best-of-2 counts prompts too (its trainer, src/online_bok_trainer.py, samples each of a batch's prompts twice):
#   hf:          512 prompts a batch, 1,024 responses here (as online DPO's hf), 262,144 responses = 256 updates;
# and its loss sums each chosen response's token NLL and averages over responses (--nll-mean sequence).
# RLOO and PPO count responses in the paper's code too: 512 a batch on 4 GPUs, 131,072 in all. The paper ran
# RLOO, PPO and best-of-2 at 410m only; at 2.8b these commands add gradient checkpointing (our choice).
set -euo pipefail
cd "$(dirname "$0")/.."

print_only=0
if [ "${1:-}" = "--print" ]; then print_only=1; shift; fi
if [ $# -ne 3 ]; then sed -n '2,16p' "$0"; exit 2; fi
algorithm=$1 size=$2 mode=$3

case $size in 410m|1b|2.8b) ;; *) echo "error: size must be 410m, 1b or 2.8b, got $size" >&2; exit 2 ;; esac
case $mode in async|sync|hf) ;; *) echo "error: mode must be async, sync or hf, got $mode" >&2; exit 2 ;; esac
data=vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144
gold=cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr
out=runs/tldr/${algorithm}_${size}_${mode}
common=(--sft-model-path "mnoukhov/pythia${size}-sft-tldr" --reward-model-path "mnoukhov/pythia${size}-rm-tldr6.9b"
        --gold-reward-model-path None --dataset-name "$data" --dataset-train-split train
        --dataset-eval-split validation --max-prompt-length 512 --response-length 53 --temperature 0.7
        --missing-eos-mode replace --missing-eos-penalty -1.0 --learning-rate 3e-6 --num-ppo-epochs 1
        --num-mini-batches 1 --deepspeed-config ds_configs/zero2.json --eval-every 16 --num-eval-prompts 512
        --save-every 64 --track --wandb-project-name async-rlhf-tldr --exp-name "${algorithm}_${size}_${mode}"
        --output-dir "$out")

# Responses per device and micro-batch x accumulation steps, by size (pairs x 2 for online DPO).
case $size in
  410m) vllm_batch=(42 8) hf_dpo_batch=(64 4) hf_batch=(16 8) ;;
  1b) vllm_batch=(16 21) hf_dpo_batch=(32 8) hf_batch=(16 8) ;;
  2.8b) vllm_batch=(12 28) hf_dpo_batch=(8 32) hf_batch=(4 32 --gradient-checkpointing) ;;
esac
batch() { echo --per-device-train-batch-size "$1" --gradient-accumulation-steps "$2" "${@:3}"; }

case $algorithm/$mode in
  online_dpo/async|online_dpo/sync)
    train=(deepspeed --num_gpus 3 online_dpo_vllm.py --k 2 --beta 0.1 --loss-type sigmoid --vllm-gpu 3
           $(batch "${vllm_batch[@]}") --total-episodes 258048)
    [ "$mode" = sync ] && train+=(--sync) || train+=(--off-policy-steps 1) ;;
  online_dpo/hf) train=(deepspeed --num_gpus 4 online_dpo.py --k 2 --beta 0.1 --loss-type sigmoid
                        $(batch "${hf_dpo_batch[@]}") --total-episodes 262144) ;;
  rloo/hf) train=(deepspeed --num_gpus 4 rloo.py --k 2 --kl-coef 0.05 $(batch "${hf_batch[@]}")
                  --total-episodes 131072) ;;
  bok/hf) train=(deepspeed --num_gpus 4 bok.py --k 2 --nll-mean sequence $(batch "${hf_dpo_batch[@]}")
                 --total-episodes 262144) ;;
  ppo/hf) train=(deepspeed --num_gpus 4 ppo.py --kl-coef 0.05 --gamma 1.0 --lam 0.95 --vf-coef 0.1 --cliprange 0.2
                 --cliprange-value 0.2 $(batch "${hf_batch[@]}") --total-episodes 131072) ;;
  online_dpo/*|rloo/*|bok/*|ppo/*) echo "error: the paper's code gives 4-GPU asynchronous TL;DR settings for online_dpo only; $algorithm runs in mode hf here (its ${algorithm}_vllm.py takes the same arguments)" >&2; exit 2 ;;
  *) echo "error: algorithm must be online_dpo, ppo, rloo or bok, got $algorithm" >&2; exit 2 ;;
esac

evaluate=(python evaluate.py --checkpoints "$out/RUN" --sft-model-path "mnoukhov/pythia${size}-sft-tldr"
          --gold-reward-model-path "$gold" --dataset-name "$data" --dataset-eval-split validation
          --max-prompt-length 512 --response-length 128 --temperature 0.01 --track
          --wandb-project-name async-rlhf-tldr)

echo "${train[*]} ${common[*]}"
echo "${evaluate[*]}   # RUN: the run directory the first command created"
[ $print_only = 1 ] && exit 0
"${train[@]}" "${common[@]}"
run=$(ls -td "$out"/*__* | head -n 1)
"${evaluate[@]/$out\/RUN/$run}"
