"""Loading what a run reads: the dataset's prompts (and answers), the tokenizer and its stop token, the models; the
batches of prompt indices and their padding. Every way a dataset or model can be wrong is bad input (checks.fail).
What here changes what is learned: a prompt longer than --max-prompt-length keeps its last tokens; a chat whose last
turn is the assistant's (a reference reply) is prompted without it; every model runs with dropout off (as sampling
does); under LoRA, PPO's value model trains its score head whole beside its adapter."""

import os

import torch
from datasets import load_dataset
from datasets.exceptions import DatasetGenerationError
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

from checks import fail


def read_dataset(args):
    """--dataset-name (checks.check_dataset_path has found it) through datasets' load_dataset (a directory of JSON
    lines or parquet files, or a hub id). Every way it can fail is bad input: one line naming the argument, exit
    code 2."""
    try:
        return load_dataset(args.dataset_name)
    except StopIteration:  # what datasets' JSON loader raises on an empty file
        files = sorted(os.listdir(args.dataset_name)) if os.path.isdir(args.dataset_name) else []
        empty = [f for f in files if os.path.getsize(os.path.join(args.dataset_name, f)) == 0]
        fail("dataset_name", f"cannot load {args.dataset_name}: {', '.join(empty) or 'a data file'} is empty")
    except (OSError, ValueError, DatasetGenerationError) as error:  # unreadable, a line that is not JSON, ...
        cause = str(error.__cause__ or error).strip() or type(error).__name__
        fail("dataset_name", f"cannot load {args.dataset_name}: {cause.splitlines()[0]}")


def load_prompts(args, tokenizer):
    """Token ids of the train and eval splits' prompts and, with --rule-reward, their answers (else Nones). A prompt is
    the `query` column's text, or the `messages` column's chat in the tokenizer's chat template with the generation
    prompt (a last assistant turn, the reference reply as in No Robots, is left out)."""
    dataset = read_dataset(args)
    prompts, answers = {}, {}
    for argument in ("dataset_train_split", "dataset_eval_split"):
        split = getattr(args, argument)
        if split not in dataset:
            fail(argument, f"dataset {args.dataset_name} has no split {split!r} (it has {sorted(dataset)})")
        columns = dataset[split].column_names
        if "query" not in columns and "messages" not in columns:
            fail("dataset_name", f"split {split!r} has no `query` or `messages` column (it has {columns})")
        if args.rule_reward is not None and args.answer_column not in columns:
            fail("answer_column", f"split {split!r} of {args.dataset_name} has no {args.answer_column!r} column "
                                  f"(it has {columns})")
        if len(dataset[split]) == 0:
            fail(argument, f"split {split!r} of {args.dataset_name} is empty")
        where = f"split {split!r} of {args.dataset_name}"
        if "query" in columns:
            texts = check_texts(list(dataset[split]["query"]), where)
        elif tokenizer.chat_template is None:
            fail("dataset_name", f"split {split!r} holds `messages` but the tokenizer of {args.sft_model_path} "
                                 "has no chat template")
        else:
            texts = [tokenizer.apply_chat_template(chat[:-1] if chat[-1]["role"] == "assistant" else chat,
                                                   tokenize=False, add_generation_prompt=True)
                     for chat in check_chats(list(dataset[split]["messages"]), where)]
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]  # a template's BOS is in its text
        prompts[argument] = [q[-args.max_prompt_length:] for q in ids]
        answers[argument] = ([None] * len(ids) if args.rule_reward is None else
                             check_answers(args, list(dataset[split][args.answer_column]), where))
    return (prompts["dataset_train_split"], prompts["dataset_eval_split"], answers["dataset_train_split"],
            answers["dataset_eval_split"])


def check_texts(texts, where, column="query", argument="dataset_name"):
    """A split's column of texts (`where` names the split), each row a non-empty text, else bad input naming the
    argument that chose the column and the row."""
    for row, text in enumerate(texts):
        if not isinstance(text, str) or not text:
            fail(argument, f"{where}, row {row}: `{column}` must be a non-empty text, got {text!r}")
    return texts


def check_chats(chats, where):
    """A split's `messages` column, each row a non-empty list of {"role": text, "content": text} turns."""
    for row, chat in enumerate(chats):
        if not (isinstance(chat, list) and chat and all(
                isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
                for turn in chat)):
            fail("dataset_name", f"{where}, row {row}: `messages` must be a list of turns "
                                 f"{{\"role\": text, \"content\": text}}, got {str(chat)[:80]!r}")
    return chats


def check_answers(args, answers, where):
    """A split's --answer-column, each row a text or a number, not empty: as texts."""
    for row, answer in enumerate(answers):
        if not isinstance(answer, (str, int, float)) or isinstance(answer, bool) or str(answer) == "":
            fail("answer_column", f"{where}, row {row}: {args.answer_column!r} must be a non-empty text or number, "
                                  f"got {answer!r}")
    return [str(answer) for answer in answers]


def load_tokenizer(path, trust_remote_code):
    """A tokenizer whose pad token is used for nothing else: padding is found by comparing token ids with it. Where
    there is none (Pythia) or it is EOS (SmolLM2, Qwen2.5, Llama 3: every EOS, also a chat template's `<|im_end|>`,
    would be masked as padding), `[PAD]` is added, to this tokenizer only. Its id may lie past the vocabulary: no
    model reads it (forward() and generate() give padded positions token 0 under a zero attention mask), the
    embeddings are not resized, so the learner's softmax is vLLM's and checkpoints keep the model's own vocabulary."""
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": "[PAD]"})
    return tokenizer


def stop_token_id(args, tokenizer):
    if args.stop_token == "eos":
        if tokenizer.eos_token_id is None:
            fail("stop_token", "the tokenizer has no EOS token; name a stop token")
        return tokenizer.eos_token_id
    ids = tokenizer.encode(args.stop_token, add_special_tokens=False)
    if len(ids) != 1:
        fail("stop_token", f"{args.stop_token!r} is not a single token of the tokenizer (it is {len(ids)} tokens)")
    return ids[0]


def load_data(args, prompts_per_rank):
    """The tokenizer, the stop token's id, the tokenised train and eval prompts and their answers (Nones without
    --rule-reward), checked (with the reward models' tokenizers) before any model is loaded."""
    tokenizer = load_tokenizer(args.sft_model_path, args.trust_remote_code)
    stop_id = stop_token_id(args, tokenizer)
    train_prompts, eval_prompts, train_answers, eval_answers = load_prompts(args, tokenizer)
    if len(train_prompts) < prompts_per_rank * args.world_size:
        fail("per_device_train_batch_size", f"a batch needs {prompts_per_rank * args.world_size} prompts; "
                                            f"the train split has {len(train_prompts)}")
    for argument in ("reward_model_path", "gold_reward_model_path"):  # they score the policy's token ids
        path = getattr(args, argument)
        if path and load_tokenizer(path, args.trust_remote_code).get_vocab() != tokenizer.get_vocab():
            fail(argument, f"the tokenizer of {path} differs from the policy's")
    return tokenizer, stop_id, train_prompts, eval_prompts, train_answers, eval_answers


def load_model(args, path, reward=False, trained=False):
    """A causal LM or, with `reward`, a one-label sequence classifier (None without a path), with dropout off (it would
    make the log-probabilities of the same tokens disagree) and its own vocabulary (see load_tokenizer); a `trained`
    model under --gradient-checkpointing checkpoints (transformers does so only in training mode)."""
    if path is None:
        return None
    dtype_and_code = dict(dtype=torch.bfloat16 if args.bf16 else torch.float32, trust_remote_code=args.trust_remote_code)
    if reward:
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, **dtype_and_code)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, **dtype_and_code)
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):  # the attention's own, in training mode
            module.attention_dropout = 0.0
    if trained and args.gradient_checkpointing:
        model.gradient_checkpointing_enable()
        model.train()
    return model


def with_lora(args, model):
    """`model` as a peft model whose only trained weights are a LoRA adapter (--lora-rank, --lora-alpha, --lora-dropout
    on --lora-target-modules: all-linear is every linear layer but the output layer); the base weights are frozen. A
    sequence classifier (PPO's value model) also trains its `score` head whole (peft's SEQ_CLS task)."""
    from peft import LoraConfig, get_peft_model

    targets = args.lora_target_modules if args.lora_target_modules == "all-linear" else args.lora_target_modules.split(",")
    classifier = model.get_output_embeddings() is None  # a causal LM's output layer is its output embeddings
    return get_peft_model(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                                            target_modules=targets, task_type="SEQ_CLS" if classifier else None))


def prompt_batch(num_prompts, per_rank, update, seed, rank, world_size):
    """This rank's prompt indices for generation batch `update`: shuffled epochs, no repeats within one."""
    per_batch = per_rank * world_size
    batches_per_epoch = num_prompts // per_batch
    epoch, position = divmod(update, batches_per_epoch)
    order = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    start = position * per_batch + rank * per_rank
    return order[start: start + per_rank]


def left_pad(sequences, pad_token_id, device):
    width = max(len(s) for s in sequences)
    out = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
    for i, s in enumerate(sequences):
        out[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
    return out.to(device)


def right_pad(sequences, pad_value, device):
    """Lists of token ids (an int pad value) or log-probabilities (a float one) as one padded tensor."""
    width = max(1, max(len(s) for s in sequences))
    out = torch.full((len(sequences), width), pad_value)
    for i, s in enumerate(sequences):
        out[i, : len(s)] = torch.tensor(s, dtype=out.dtype)
    return out.to(device)
