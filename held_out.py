"""Evaluation on held-out prompts during training: greedy responses, scored by the script's own scoring (the reward
model and the gold model, or the rule), averaged over every rank. The script passes its generation and scoring
functions, so evaluation samples and scores as training does. Nothing here changes what is learned."""

import torch
import torch.distributed as dist

from data import left_pad
from distributed import unwrapped_for_generation


@torch.no_grad()
def evaluate(args, policy, reward_model, gold_model, eval_prompts, eval_answers, tokenizer, stop_id, device,
             generate, truncate_response, score_responses):
    """Greedy responses to held-out prompts, scored by the reward model (and the gold model) or the rule (with
    `last_number`, eval/scores is the accuracy). `generate`, `truncate_response` and `score_responses` are the
    script's."""
    rank, world, size = dist.get_rank(), dist.get_world_size(), args.per_device_train_batch_size
    total = min(args.num_eval_prompts, len(eval_prompts))
    indices = list(range(rank, total, world))
    # Every rank runs as many batches as rank 0 (under ZeRO-3 each forward pass gathers parameters from all ranks):
    # a rank with fewer prompts fills up with the first, counted 0 times.
    counted = torch.tensor([1.0] * len(indices) + [0.0] * (-(-total // world) - len(indices)), device=device)
    indices += [0] * (len(counted) - len(indices))
    sums = torch.zeros(4, dtype=torch.float64, device=device)  # on the device: NCCL reduces only CUDA tensors
    samples = []
    for start in range(0, len(indices), size):
        batch, weight = indices[start: start + size], counted[start: start + size]
        queries = left_pad([eval_prompts[i] for i in batch], tokenizer.pad_token_id, device)
        with unwrapped_for_generation(policy) as model:
            responses = generate(model, queries, tokenizer.pad_token_id, stop_id, args.response_length)
        responses = truncate_response(responses, stop_id, tokenizer.pad_token_id)
        query_responses = torch.cat([queries, responses], 1)
        scores = score_responses(args, reward_model, query_responses, queries.shape[1],
                                 [eval_answers[i] for i in batch], tokenizer)
        gold = (score_responses(args, gold_model, query_responses, queries.shape[1], None, tokenizer) if gold_model
                else scores * 0)
        lengths = (responses != tokenizer.pad_token_id).sum(1)
        sums += torch.stack([(scores * weight).sum(), (gold * weight).sum(), (lengths * weight).sum(),
                             weight.sum()]).double()
        if not samples:
            samples = [[tokenizer.decode(q, skip_special_tokens=True), tokenizer.decode(r, skip_special_tokens=True),
                        round(s.item(), 3)] for q, r, s in zip(queries[:4], responses[:4], scores[:4])]
    dist.all_reduce(sums)
    metrics = {"eval/scores": sums[0] / sums[3], "eval/response_length": sums[2] / sums[3]}
    if gold_model is not None:
        metrics["eval/gold_scores"] = sums[1] / sums[3]
    return {k: v.item() for k, v in metrics.items()}, samples
