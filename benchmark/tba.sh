#!/usr/bin/env bash
# TBA's own experiments (Bartoldson et al. 2025, "Trajectory Balance with Asynchrony", arXiv 2503.18929) with
# tba_vllm.py: TL;DR summarisation with Pythia and GSM8K with Rho-1B, then evaluate.py on every checkpoint.
#
#   bash benchmark/tba.sh tldr <size>           # size: 410m | 1b | 2.8b; runs one experiment, then evaluates it
#   bash benchmark/tba.sh gsm8k                 # writes GSM8K's data (as benchmark/gsm8k.sh), trains, evaluates
#   bash benchmark/tba.sh --print tldr <size>   # only prints the commands (also for gsm8k)
#
# Meant for one node with 2 NVIDIA A100 80GB (the learner on GPU 0, vLLM on GPU 1), CUDA, `pip install -r
# requirements.txt`, a Hugging Face hub connection and `wandb login`. It has NOT been run by this project (no GPU,
# no hub access where it was written). tests/test_tldr.py checks the printed commands against the values below.
#
# Settings, from TBA's code (github.com/bbartoldson/TBA: configs/tba_pythia2.8b_tldr.yml, configs/tba_rho1b_gsm8k.yml,
# launch_training_*.sh, and the TBAConfigTLDR / TBAConfigGSM8K defaults in src/tba_trainer_*.py):
#   TL;DR: SFT mnoukhov/pythia<size>-sft-tldr, reward model mnoukhov/pythia<size>-rm-tldr6.9b, 20 responses a prompt,
#     20 x 8 accumulation = 160 responses (8 prompts) a step, 40,960 responses = 256 steps, learning rate 3e-6,
#     responses of 128 tokens, prompts of up to 512, temperature 0.7, a response without EOS scored -1 (TRL's
#     non_eos_penalty), beta 1.0 falling linearly towards 0.05 at step 129 and set to 0.05 from step 32 (1.0 -> 0.78,
#     then 0.05: --beta-anneal-updates 128 --beta-cut-update 32), a prompt of the newest batch with probability 0.5, else
#     any prompt with its responses drawn by exp(score) (inv_temp 1), 100 responses a prompt in the buffer, 10,000
#     responses of the SFT policy in it before the first step (--buffer-prefill: 63 batches, 10,080).
#   GSM8K: SFT realtreetune/rho-1b-sft-GSM8K, the last-number reward, 20 responses a prompt, 20 x 7 = 140 responses
#     (7 prompts) a step, 98,000 responses = 700 steps, learning rate 1e-5, responses of 512 tokens, no penalty for a
#     missing EOS, beta 0.014 (the launcher's) falling linearly to 0.004 over 500 steps, the newest batch with probability
#     0.95, else uniformly (inv_temp 0), 500 responses of the SFT policy in the buffer before the first step (4
#     batches, 560), bf16.
#   Both: no gradient clipping (ds_configs/zero2_noclip.json; the TB loss's gradient scales as 1 / beta, which a clip
#   at 1.0 would cut at nearly every step).
# Where this differs from TBA's code:
# - Generation: TBA runs 3 searcher GPUs generating continuously and sends them the trainer's weights every k = 10
#   steps (TL;DR) or 2 (GSM8K), so its newest data are k to 2k - 1 steps stale, (3k - 1) / 2 on average (its Table 1:
#   15 for k = 10); here one vLLM engine generates each batch with the weights of exactly K updates before, K that
#   mean rounded up (--off-policy-steps 15 and 3).
# - TBA's searchers go on generating while the trainer steps (the buffer grows by their pace); here the buffer grows
#   by one batch an update after its pre-fill, rounded up to whole batches. On GSM8K TBA generates 24 responses a
#   prompt and trains on 20; here a prompt's k responses are generated. TBA draws buffered prompts without
#   replacement until each has been drawn; here each draw is independent.
# - The learning rate: TBA's GSM8K uses warm-up, stable and decay phases (350 stable steps, 600 of decay); here it
#   decays linearly to zero. Adam's eps is 1e-5 here (every script), 1e-8 in TBA.
# - Precision: TBA trains TL;DR in fp32 with its searchers in fp16; here the learner and vLLM share one dtype, bf16.
# - The GSM8K prompt: the SFT model's own template (benchmark/gsm8k.sh's), not TBA's.
set -euo pipefail
cd "$(dirname "$0")/.."

print_only=0
if [ "${1:-}" = "--print" ]; then print_only=1; shift; fi
task=${1:-}
case $task in
  tldr) [ $# -eq 2 ] || { sed -n '2,8p' "$0"; exit 2; }
        size=$2
        case $size in 410m|1b|2.8b) ;; *) echo "error: size must be 410m, 1b or 2.8b, got $size" >&2; exit 2 ;; esac
        data=vwxyzjn/summarize_from_feedback_tldr_3_filtered_oai_preprocessing_1706381144
        out=runs/tba/tldr_$size
        train=(deepspeed --num_gpus 1 tba_vllm.py --vllm-gpu 1 --sft-model-path "mnoukhov/pythia${size}-sft-tldr"
               --reward-model-path "mnoukhov/pythia${size}-rm-tldr6.9b" --gold-reward-model-path None
               --dataset-name "$data" --dataset-train-split train --dataset-eval-split validation
               --max-prompt-length 512 --response-length 128 --temperature 0.7 --missing-eos-mode replace
               --missing-eos-penalty -1.0 --k 20 --per-device-train-batch-size 20 --gradient-accumulation-steps 8
               --total-episodes 40960 --learning-rate 3e-6 --beta 1.0 --beta-final 0.05 --beta-anneal-updates 128
               --beta-cut-update 32 --recent-prob 0.5 --inv-temp 1 --buffer-size 100 --buffer-prefill 10000
               --off-policy-steps 15 --bf16
               --deepspeed-config ds_configs/zero2_noclip.json --eval-every 16 --num-eval-prompts 512 --save-every 64
               --track --wandb-project-name tba-tldr --exp-name "tba_tldr_$size" --output-dir "$out")
        evaluate=(python evaluate.py --checkpoints "$out/RUN" --sft-model-path "mnoukhov/pythia${size}-sft-tldr"
                  --gold-reward-model-path cleanrl/EleutherAI_pythia-6.9b-deduped__reward__tldr --dataset-name "$data"
                  --dataset-eval-split validation --max-prompt-length 512 --response-length 128 --temperature 0.01
                  --track --wandb-project-name tba-tldr) ;;
  gsm8k) [ $# -eq 1 ] || { sed -n '2,8p' "$0"; exit 2; }
         sft=realtreetune/rho-1b-sft-GSM8K data=runs/gsm8k/data out=runs/tba/gsm8k
         train=(deepspeed --num_gpus 1 tba_vllm.py --vllm-gpu 1 --sft-model-path "$sft" --rule-reward last_number
                --answer-column answer --dataset-name "$data" --dataset-train-split train --dataset-eval-split test
                --max-prompt-length 512 --response-length 512 --temperature 0.7 --missing-eos-penalty 0 --k 20
                --per-device-train-batch-size 20 --gradient-accumulation-steps 7 --total-episodes 98000
                --learning-rate 1e-5 --beta 0.014 --beta-final 0.004 --beta-anneal-updates 500 --recent-prob 0.95
                --inv-temp 0 --buffer-size 100 --buffer-prefill 500 --off-policy-steps 3 --bf16
                --deepspeed-config ds_configs/zero2_noclip.json
                --eval-every 50 --num-eval-prompts 256 --save-every 100 --track --wandb-project-name tba-gsm8k
                --exp-name tba_gsm8k --output-dir "$out")
         evaluate=(python evaluate.py --checkpoints "$out/RUN" --sft-model-path "$sft" --rule-reward last_number
                   --dataset-name "$data" --dataset-eval-split test --max-prompt-length 512 --response-length 512
                   --temperature 0 --track --wandb-project-name tba-gsm8k) ;;
  *) echo "error: the task must be tldr or gsm8k, got '$task'" >&2; exit 2 ;;
esac

echo "${train[*]}"
echo "${evaluate[*]}   # RUN: the run directory the first command created"
[ $print_only = 1 ] && exit 0
if [ "$task" = gsm8k ] && [ ! -f "$data/test.jsonl" ]; then
  eval "$(bash benchmark/gsm8k.sh --print rloo async | head -n 1)"  # the command that writes GSM8K's data
fi
"${train[@]}"
run=$(ls -td "$out"/*__* | head -n 1)
"${evaluate[@]/$out\/RUN/$run}"
