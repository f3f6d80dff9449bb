"""``vkformers train``: train or fine-tune (fully or with LoRA) a causal LM on text, JSONL, Parquet or a hub dataset,
or (``--task sequence-classification``) a text classifier on labelled CSV, JSONL or Parquet rows (--text-column,
--label-column), with accuracy and macro F1 on the held-out rows printed and written to metrics.jsonl, or
(``--task token-classification``) a tagger (NER) on rows of words and one tag per word (default columns "tokens"
and "ner_tags", as CoNLL-2003 on the hub; CSV cells hold space-separated words), each tag on its word's first
sub-token, with seqeval's entity precision, recall and F1 on the held-out rows, or (``--task question-answering``)
extractive QA on SQuAD-format JSONL/Parquet rows (question, context, answers), contexts cut into windows of
--seq-len tokens overlapping by --doc-stride, with SQuAD exact match and F1 on the held-out questions, or
(``--task seq2seq``) a sequence-to-sequence model (T5, BART, Marian, ...) on rows of a source and a target text
(default columns "source" and "target"; a dotted name such as translation.en reads into nested objects), the
targets tokenized as the model's target side (--target-len tokens at most) and their ids the labels.

QLoRA: --quantization nf4 (or q4_0, q4_1, q8_0, q4_k) packs the model's Linear weights while loading; they stay
frozen and LoRA adapters (--lora-rank) train on top, with --gradient-checkpointing and --optim adamw_8bit for less
memory still. A .gguf model keeps its own packed blocks, so it trains with --lora-rank only too.

Writes into --out: checkpoints/checkpoint-<step>/ (atomic, verified by --resume, the last --keep),
metrics.jsonl (one line per step), loss_curve.png (with matplotlib: pip install 'vkformers[plot]'), and
final/ (the trained model as save_pretrained writes it, or the PEFT adapter; --merge folds the adapter
into the model instead). Nothing is written through a symbolic link inside --out. --push-to-hub ORG/NAME then
uploads final/ to that hub repo, as transformers' Trainer does with push_to_hub.

Several GPUs (pip install 'vkformers[mpi]'): --data-parallel N starts N processes on this machine, one per Vulkan
device, each with --batch-size sequences of every step (N times the batch of one process); across machines, start
the command under mpiexec/mpirun instead (one process per GPU). --shard-optimizer keeps each rank's share of the
AdamW state only (ZeRO-1); --grad-comm bf16 halves the gradient traffic.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import traceback
from pathlib import Path

from vkformers.cli.model_option import add_gguf_file_option, resolve_model
from vkformers.cli.options import (fraction, non_negative_int, non_negative_number, positive_int, positive_number,
                                   unit_interval, whole_number)
from vkformers.engine.quantized import QUANTIZE_FORMATS
from vkformers.errors import QuantizationError, VkformersError
from vkformers.models.atomic import refuse_symlink, write_bytes_atomic
from vkformers.models.atomic import open_for_append
from vkformers.models.loading import (AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                                      AutoModelForSequenceClassification, AutoModelForTokenClassification, load_config,
                                      resolve_checkpoint)
from vkformers.models.hub import create_hub_repo, upload_to_hub
from vkformers.models.quantize import quantized_weight_names, refuse_quantized
from vkformers.models.slow_tokenizers import SLOW_TOKENIZER_FILES
from vkformers.training import distributed
from vkformers.training import (Batches, LoraConfig, Trainer, TrainingConfig, apply_lora, fixed_batches,
                                hf_dataset_files, init_weights, load_dataset, load_tokenizer)
from vkformers.training.labelled import (LabelledBatches, evaluate_classifier, evaluate_question_answering,
                                        evaluate_token_classifier, labelled_batches, load_labelled,
                                        load_question_answering, load_seq2seq, load_token_labelled)
from vkformers.training.trainer import PLOT_HINT, check_output_folder, check_token_ids, model_vocab_size

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "generation_config.json", *SLOW_TOKENIZER_FILES)
DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
TASKS = ("causal-lm", "sequence-classification", "token-classification", "question-answering", "seq2seq")
# PEFT's task_type of each task's adapters (AutoPeftModelFor<Task> loads only its own)
PEFT_TASK_TYPES = {"causal-lm": "CAUSAL_LM", "sequence-classification": "SEQ_CLS",
                   "token-classification": "TOKEN_CLS", "question-answering": "QUESTION_ANS",
                   "seq2seq": "SEQ_2_SEQ_LM"}
HEAD_TASKS = ("sequence-classification", "token-classification", "question-answering")  # a new head on a base
CLASS_TASKS = ("sequence-classification", "token-classification")  # heads whose labels are named classes
# the data columns each labelled task reads by default (--text-column, --label-column)
DEFAULT_COLUMNS = {"sequence-classification": ("text", "label"), "token-classification": ("tokens", "ner_tags"),
                   "question-answering": ("context", "answers"), "seq2seq": ("source", "target")}
OPTIMS = ("adamw", "adamw_8bit", "adamw_bf16_states")  # optim.OPTIMIZERS (not imported here: --help stays fast)


def add_parser(subparsers):
    p = subparsers.add_parser("train", help="train or fine-tune a causal LM, a task head or a seq2seq model (full "
                              "or LoRA)",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="model folder, hub repo id, .gguf file or org/repo:QUANT (a hub "
                                                   "repo's GGUF file by its tag)")
    add_gguf_file_option(p)
    p.add_argument("--from-scratch", action="store_true", help="random weights (only the model's config.json is read)")
    p.add_argument("--tokenizer", help="tokenizer folder, hub repo id or org/repo:QUANT (a GGUF file's; default: the "
                   "model's); 'byte' for UTF-8 bytes")
    p.add_argument("--quantization", choices=QUANTIZE_FORMATS,
                   help="pack the model's Linear weights in these blocks while loading (QLoRA: needs --lora-rank; "
                        "nf4 is QLoRA's 4-bit NormalFloat); a GGUF file keeps its own blocks without it")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--task", choices=TASKS, default="causal-lm",
                   help="causal-lm (default); sequence-classification, token-classification or "
                        "question-answering: a head on the base model, trained on labelled rows (--text-column, "
                        "--label-column); seq2seq: an encoder-decoder on source and target texts")
    data = p.add_argument_group("data")
    data.add_argument("--data", nargs="+", metavar="PATH", help="text/JSONL/Parquet files or folders")
    data.add_argument("--hf-dataset", metavar="ORG/NAME", help="a hub dataset (Parquet/JSONL files, cached)")
    data.add_argument("--split", default="train", help="hub dataset split (default train)")
    data.add_argument("--eval-data", nargs="+", metavar="PATH", help="held-out files (default: --eval-fraction)")
    data.add_argument("--eval-fraction", type=fraction, default=0.02, help="share of sequences held out (default 0.02)")
    data.add_argument("--text-column", help="JSONL/Parquet column with the text (default 'text'; 'tokens', the "
                                            "words, for token-classification)")
    data.add_argument("--label-column", help="the column with the label (default 'label'; 'ner_tags', one tag "
                                             "per word, for token-classification; 'answers' for "
                                             "question-answering)")
    data.add_argument("--question-column", default="question", help="question-answering: the column with the "
                                                                   "question (default 'question')")
    data.add_argument("--doc-stride", type=non_negative_int, help="question-answering: tokens shared by the "
                                                                  "windows of a long context (default seq-len / 4)")
    data.add_argument("--prompt-column", help="column with prompts, masked out of the loss")
    data.add_argument("--completion-column", help="column with completions (with --prompt-column)")
    data.add_argument("--no-packing", dest="packing", action="store_false",
                      help="one sequence per document or conversation, cut at --seq-len and padded after its end "
                           "(TRL's SFT default); default: documents packed end to end into sequences of --seq-len")
    data.add_argument("--assistant-only-loss", action="store_true",
                      help="conversations (rows with a 'messages' column, rendered with the chat template): train "
                           "on the assistant turns only (default: every token, as TRL's SFT)")
    lora = p.add_argument_group("LoRA (PEFT-compatible adapters; without --lora-rank the whole model trains)")
    lora.add_argument("--lora-rank", type=positive_int, help="adapter rank r")
    lora.add_argument("--lora-alpha", type=positive_number, help="alpha (default 2 * rank)")
    lora.add_argument("--lora-dropout", type=fraction, default=0.0)
    lora.add_argument("--lora-targets", nargs="+", metavar="NAME",
                      help="module names to adapt (default per family, e.g. q_proj v_proj); all-linear: every "
                           "Linear layer but the output head, as PEFT; one value with regex characters is a regular "
                           "expression on full module names")
    lora.add_argument("--rslora", action="store_true", help="scale by alpha/sqrt(r) (rsLoRA)")
    lora.add_argument("--modules-to-save", nargs="+", metavar="NAME", help="modules trained fully and saved too")
    lora.add_argument("--merge", action="store_true", help="write final/ as the merged model, not the adapter")
    loop = p.add_argument_group("training")
    loop.add_argument("--steps", type=positive_int, default=None, help="optimizer steps (default 1000)")
    loop.add_argument("--epochs", type=positive_number, default=None,
                      help="train this many passes over the data instead of --steps, every sequence once a "
                           "pass (as transformers' num_train_epochs; a fraction is a part of a pass)")
    loop.add_argument("--batch-size", type=positive_int, default=8)
    loop.add_argument("--seq-len", type=whole_number(2), default=512, help="tokens per sequence (at least 2)")
    loop.add_argument("--target-len", type=positive_int, default=None,
                      help="seq2seq: tokens per target at most (default --seq-len)")
    loop.add_argument("--lr", type=positive_number, default=2e-4)
    loop.add_argument("--schedule", choices=("constant", "linear", "cosine"), default="cosine")
    loop.add_argument("--warmup", type=non_negative_int, default=0, help="warmup steps")
    loop.add_argument("--min-lr-ratio", type=unit_interval, default=0.0)
    loop.add_argument("--weight-decay", type=non_negative_number, default=0.0)
    loop.add_argument("--clip", type=non_negative_number, default=1.0, help="max global gradient norm (0: off)")
    loop.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimizer step")
    loop.add_argument("--eval-every", type=non_negative_int, default=0,
                      help="steps between evaluations (0: at the end)")
    loop.add_argument("--eval-batches", type=positive_int, default=8)
    loop.add_argument("--save-every", type=non_negative_int, default=0,
                      help="steps between checkpoints (0: only at the end)")
    loop.add_argument("--keep", type=non_negative_int, default=2, help="checkpoints kept (0: all)")
    loop.add_argument("--precision", choices=tuple(DTYPES), default="fp32",
                      help="weights' dtype; bf16/fp16 train with float32 masters, fp16 with dynamic loss scaling")
    loop.add_argument("--seed", type=non_negative_int, default=0, help="data order, dropout and adapter init")
    loop.add_argument("--optim", choices=OPTIMS, default="adamw",
                      help="AdamW moments in float32 (adamw), 8-bit blockwise as bitsandbytes' AdamW8bit "
                           "(adamw_8bit, a quarter of the memory) or bfloat16 (adamw_bf16_states, half)")
    loop.add_argument("--no-master-weights", action="store_true",
                      help="with --precision bf16: update the bfloat16 weights in place (as torch.optim.AdamW on a "
                           "bfloat16 model), no float32 master copy: 4 bytes per parameter less; updates under half "
                           "a bfloat16 step of a weight are lost")
    loop.add_argument("--gradient-checkpointing", action="store_true",
                      help="keep only each layer's input and recompute the layer in the backward pass: less "
                           "activation memory for one more forward per step, the same gradients")
    parallel = p.add_argument_group("data parallel (several GPUs; needs pip install 'vkformers[mpi]')")
    parallel.add_argument("--data-parallel", type=positive_int, metavar="N",
                          help="start N processes on this machine, one per Vulkan device (under mpiexec: the "
                               "launcher's process count, checked against N)")
    parallel.add_argument("--grad-comm", choices=("fp32", "bf16"), default="fp32",
                          help="dtype of the gradients sent between ranks (default fp32)")
    parallel.add_argument("--shard-optimizer", action="store_true",
                          help="ZeRO-1: each rank keeps the AdamW state of its share of the weights only")
    parallel.add_argument("--bucket-mb", type=positive_number, default=25.0,
                          help="megabytes of gradients per all-reduce (default 25)")
    parallel.add_argument("--share-device", action="store_true",
                          help="run every rank of this machine on one device (for testing; also "
                               "VKFORMERS_DATA_PARALLEL_SHARE_DEVICE=1)")
    loop.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                      help="continue from the newest checkpoint in --out (or the folder given)")
    loop.add_argument("--no-progress", action="store_true", help="no progress bar")
    hub = p.add_argument_group("hub (transformers' push_to_hub)")
    hub.add_argument("--push-to-hub", metavar="ORG/NAME", help="upload final/ (the model or the adapter, with the "
                     "tokenizer's files) to this hub repo in one commit, creating it where missing")
    hub.add_argument("--hub-private", action="store_true", help="create the repo private")
    hub.add_argument("--hub-token", default=None, help="a token with write access (default: HF_TOKEN or the saved "
                     "login)")
    p.set_defaults(func=run)
    return p


def lora_targets(values):
    if not values:
        return None
    if len(values) == 1 and (values[0] == "all-linear" or any(c in values[0] for c in "*+?[]()|\\^$")):
        return values[0]
    return [t for v in values for t in v.split(",") if t]


def load_model(args, **head_options):
    auto = {"sequence-classification": AutoModelForSequenceClassification,
            "token-classification": AutoModelForTokenClassification,
            "question-answering": AutoModelForQuestionAnswering,
            "seq2seq": AutoModelForSeq2SeqLM}.get(args.task, AutoModelForCausalLM)
    if args.from_scratch:
        model = auto.from_config(load_config(resolve_checkpoint(args.model)), **head_options)
        init_weights(model, seed=args.seed, dtype=DTYPES[args.precision])
        model.name_or_path = str(args.model)
        return model.train()
    return auto.from_pretrained(args.model, dtype=DTYPES[args.precision], quantization=args.quantization,
                                **head_options).train()


def check_quantization_options(args) -> None:
    """Refuse, before any loading, what a quantized base cannot do: its packed weights are frozen."""
    if not args.quantization:
        return
    if not args.lora_rank:
        raise QuantizationError(f"--quantization {args.quantization} needs --lora-rank: quantized weights are frozen, "
                                "so only LoRA adapters train on top of them (QLoRA); drop --quantization for full "
                                "fine-tuning")
    if args.from_scratch:
        raise QuantizationError("--quantization applies to trained weights, not --from-scratch; train the float "
                                "model first, then fine-tune it with --quantization and --lora-rank")
    if args.merge:
        raise QuantizationError(f"--merge with --quantization {args.quantization}: the adapter cannot be folded into "
                                "packed weights; drop --merge to save the adapter, then merge it into the float model "
                                "(vkformers merge-lora)")


def copy_tokenizer_files(source, folder: Path) -> None:
    """The tokenizer's files beside the final model (those not there already), never written through a link."""
    try:
        source = resolve_checkpoint(source)
    except Exception:  # a tokenizer that is not a folder (e.g. "byte"): nothing to copy
        return
    for name in TOKENIZER_FILES:
        if (source / name).is_file() and not refuse_symlink(folder / name).exists():
            write_bytes_atomic(folder / name, (source / name).read_bytes())


def start_data_parallel(args):
    """None for a single process; else this rank's Communicator (its device chosen). With --data-parallel N and no
    launcher around, this process starts the N ranks instead and returns their exit status."""
    world = distributed.launched_world_size()
    if args.share_device:
        os.environ[distributed.SHARE_DEVICE_ENV] = "1"
    if world == 1:
        if args.data_parallel and args.data_parallel > 1:
            return distributed.launch(args.data_parallel, args.argv)
        return None
    comm = distributed.Communicator()
    try:
        if args.data_parallel and args.data_parallel != comm.size:
            raise distributed.DistributedError(f"--data-parallel {args.data_parallel} but the launcher started "
                                               f"{comm.size} processes; give the same number (or leave it out)")
        distributed.select_device(comm)
    except distributed.DistributedError as exc:
        comm.abort_on_error(f"vkformers train: error: rank {comm.rank}: {exc}")
    return comm


def run(args) -> int:
    if bool(args.data) == bool(args.hf_dataset):
        raise VkformersError("give the training data with exactly one of --data or --hf-dataset")
    check_quantization_options(args)
    check_output_folder(args.out)  # before minutes of loading
    # recorded as given (the run's files name org/repo:TAG, not this machine's cache path)
    args.model_name, args.tokenizer_name = str(args.model), args.tokenizer
    args.model = resolve_model(args.model, args.gguf_file)  # a hub repo's GGUF file fetched: its local path
    args.tokenizer = resolve_model(args.tokenizer, option="--tokenizer")
    if args.task != "causal-lm" and ((args.data_parallel or 1) > 1 or distributed.launched_world_size() > 1):
        raise VkformersError(f"--data-parallel trains --task causal-lm only; train {args.task} on one device")
    comm = start_data_parallel(args)
    if isinstance(comm, int):  # the launcher ran the ranks
        return comm
    if comm is None:
        return train(args, comm)
    try:
        return train(args, comm)
    except BaseException as exc:  # one rank failing ends them all, its message first
        if getattr(args, "debug", False) or os.environ.get("VKFORMERS_DEBUG") == "1":
            traceback.print_exc()
        text = " ".join(str(exc).split()) or type(exc).__name__
        comm.abort_on_error(f"vkformers train: error: rank {comm.rank}: {text}")
        raise


def training_steps(args, steps_per_epoch: int) -> int:
    """--steps, or the optimizer steps --epochs passes take (``steps_per_epoch``: one pass, each step reading
    batch-size x grad-accum sequences on every rank, the last one filled up), at least one; 1000 when neither is
    given. As transformers' Trainer: ceil(epochs x steps per epoch)."""
    if args.epochs is not None and args.steps is not None:
        raise VkformersError("--steps and --epochs both given: give one of them")
    if args.epochs is None:
        return 1000 if args.steps is None else args.steps
    return max(1, math.ceil(args.epochs * steps_per_epoch))


def train(args, comm) -> int:
    leader = comm is None or comm.rank == 0
    say = print if leader else (lambda *a, **k: None)
    if args.push_to_hub and leader:  # a wrong repo name or token stops the run before it trains, as transformers'
        create_hub_repo(args.push_to_hub, private=args.hub_private or None, token=args.hub_token)
    tokenizer = load_tokenizer(args.tokenizer or args.model)
    paths = args.data or hf_dataset_files(args.hf_dataset, args.split)
    head_options = {}
    if args.task == "causal-lm":
        columns = dict(text_column=args.text_column, prompt_column=args.prompt_column,
                       completion_column=args.completion_column, assistant_only_loss=args.assistant_only_loss,
                       packing=args.packing)
        dataset = load_dataset(paths, tokenizer, args.seq_len, **columns)
        if args.eval_data:
            train, held_out = dataset, load_dataset(args.eval_data, tokenizer, args.seq_len, **columns)
        else:
            train, held_out = dataset.split(args.eval_fraction)
    else:
        if args.prompt_column or args.completion_column or args.assistant_only_loss:
            raise VkformersError("--prompt-column / --completion-column / --assistant-only-loss are for causal-lm; a "
                                 "classifier reads --text-column and --label-column")
        text_column, label_column = DEFAULT_COLUMNS[args.task]
        columns = dict(text_column=args.text_column or text_column, label_column=args.label_column or label_column)
        load = load_token_labelled if args.task == "token-classification" else load_labelled
        if args.task == "seq2seq":
            columns["target_len"] = args.target_len or args.seq_len
            load = load_seq2seq
        if args.task == "question-answering":
            columns = dict(question_column=args.question_column, context_column=columns["text_column"],
                           answers_column=columns["label_column"], stride=args.doc_stride)
            load = load_question_answering
        dataset = load(paths, tokenizer, args.seq_len, **columns)
        if args.eval_data:
            train = dataset
            names = {"label_names": dataset.id2label} if args.task in CLASS_TASKS else {}
            held_out = load(args.eval_data, tokenizer, args.seq_len, **names, **columns)
        else:
            train, held_out = dataset.split(args.eval_fraction, seed=args.seed)
        head_options = dict(num_labels=len(dataset.id2label) or 1) if args.task in CLASS_TASKS else {}
        if args.task == "sequence-classification":
            head_options["problem_type"] = dataset.problem_type
        if dataset.id2label:
            head_options.update(id2label=dataset.id2label,
                                label2id={name: int(i) for i, name in dataset.id2label.items()})

    model = load_model(args, **head_options)
    if args.task in HEAD_TASKS and model.base.config.get("pad_token_id") is None:  # decoders: rows end at a pad
        model.base.config["pad_token_id"] = tokenizer.pad_token_id if tokenizer.pad_token_id is not None \
            else tokenizer.eos_token_id
        model.config["pad_token_id"] = model.base.config["pad_token_id"]
    if not args.lora_rank:  # a GGUF file's packed blocks: refused in the CLI's words (the Trainer refuses too)
        refuse_quantized(model, "full fine-tuning", "quantized weights are frozen in their packed blocks; add "
                         "--lora-rank to train LoRA adapters on top of them (QLoRA)")
    elif args.merge:
        refuse_quantized(model, "--merge", "the adapter cannot be folded into packed weights; drop --merge to save "
                         "the adapter, then merge it into a float copy of the model (vkformers merge-lora)")
    tokenizer_name = args.tokenizer or args.model
    for what, part in (("the training data", train), ("the held-out data", held_out)):
        if part is not None:  # up front: an id past the embedding would only show as a nan loss later
            check_token_ids(part.input_ids, model_vocab_size(model), f"{what} (tokenized by {tokenizer_name})")
            if args.task == "seq2seq":
                check_token_ids(part.labels, model_vocab_size(model), f"the targets of {what}")
    modules_to_save = args.modules_to_save
    if args.task in HEAD_TASKS and modules_to_save is None:  # PEFT's SEQ_CLS task: the new head trains and is saved
        modules_to_save = sorted({path.split(".")[0] for path in model.head_modules})
    if args.lora_rank:
        apply_lora(model, LoraConfig(r=args.lora_rank, lora_alpha=args.lora_alpha or 2 * args.lora_rank,
                                     lora_dropout=args.lora_dropout, target_modules=lora_targets(args.lora_targets),
                                     use_rslora=args.rslora, modules_to_save=modules_to_save,
                                     base_model_name_or_path=args.model_name,
                                     task_type=PEFT_TASK_TYPES[args.task]), seed=args.seed)
    if comm is not None:
        batches = distributed.ShardedBatches(train, args.batch_size, comm.rank, comm.size, seed=args.seed)
    elif args.task == "causal-lm":
        batches = Batches(train, args.batch_size, seed=args.seed)
    else:
        batches = LabelledBatches(train, args.batch_size, seed=args.seed)
    args.steps = training_steps(args, batches.steps_per_epoch(args.grad_accum))
    config = TrainingConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                            schedule=args.schedule, warmup=args.warmup, min_lr_ratio=args.min_lr_ratio,
                            weight_decay=args.weight_decay, clip=args.clip, grad_accum=args.grad_accum,
                            eval_every=args.eval_every, eval_batches=args.eval_batches,
                            save_every=args.save_every or args.steps, keep=args.keep, precision=args.precision,
                            seed=args.seed, optim=args.optim, gradient_checkpointing=args.gradient_checkpointing,
                            master_weights=not args.no_master_weights)
    run_info = {"model": args.model_name, "gguf_file": args.gguf_file, "data": [str(p) for p in paths],
                "tokenizer": args.tokenizer_name or args.model_name, "quantization": args.quantization,
                "lora": model.lora_config.to_peft_dict() if args.lora_rank else None}
    if args.task == "causal-lm":
        eval_batches = fixed_batches(held_out, args.batch_size, args.eval_batches) if held_out else None
    else:
        eval_batches = labelled_batches(held_out, args.batch_size, args.eval_batches) if held_out else None
    common = dict(eval_batches=eval_batches, out_dir=args.out, progress=leader and not args.no_progress,
                  run_info=run_info)
    if comm is None:
        trainer = Trainer(model, config, batches, **common)
    else:
        run_info["data_parallel"] = comm.size
        trainer = distributed.DataParallelTrainer(model, config, batches, comm=comm, comm_dtype=args.grad_comm,
                                                  shard_optimizer=args.shard_optimizer, bucket_mb=args.bucket_mb,
                                                  **common)
    trained = sum(t.numel() for t in trainer.params)
    packed = len(quantized_weight_names(model))
    ranks = f" on {comm.size} data-parallel ranks" if comm is not None else ""
    say(f"training {trained:,} parameters on {len(train):,} sequences of {train.seq_len} tokens"
          f"{f' ({len(held_out):,} held out)' if held_out else ''}, {args.precision}"
          f"{f'; {packed} quantized weights frozen under the adapters' if packed else ''}{ranks}")
    if args.resume:
        folder = trainer.resume(None if args.resume == "latest" else args.resume)
        for skipped, reason in trainer.skipped_checkpoints:
            print(f"vkformers train: skipped {skipped}: {reason}", file=sys.stderr)
        say(f"resumed from {folder} at step {trainer.step}" if folder else "no checkpoint to resume; starting fresh")
    trainer.train()
    if args.task in HEAD_TASKS and eval_batches:
        if args.task == "token-classification":
            scores = evaluate_token_classifier(model, eval_batches, dataset.id2label)
        elif args.task == "question-answering":  # every held-out question, over all its windows
            scores = evaluate_question_answering(model, held_out, args.batch_size)
        else:
            scores = evaluate_classifier(model, eval_batches)
        metrics = {f"eval_{k}": v for k, v in scores.items()}
        with open_for_append(args.out / "metrics.jsonl") as f:
            f.write(json.dumps({"step": trainer.step, **metrics}) + "\n")
        print("held-out " + ", ".join(f"{k[5:]} {v:.4f}" for k, v in metrics.items()))
    if not leader:  # rank 0 writes the final model
        return 0
    if trainer.loss_curve_file is None:
        print(f"vkformers train: note: {PLOT_HINT}", file=sys.stderr)
    final = trainer.save_final(args.out / "final", merge=args.merge)
    copy_tokenizer_files(args.tokenizer or args.model, final)
    last = trainer.history[-1] if trainer.history else {}
    summary = f"loss {last['loss']:.4f}" if "loss" in last else "no steps run"
    if last.get("eval_loss") is not None:
        summary += f", held-out loss {last['eval_loss']:.4f}"
    print(f"done: step {trainer.step}, {summary}; model in {final}, metrics in {args.out / 'metrics.jsonl'}")
    if args.push_to_hub:
        commit = upload_to_hub(final, args.push_to_hub, private=args.hub_private or None, token=args.hub_token,
                               commit_message=f"vkformers train: step {trainer.step}, {summary}")
        print(f"pushed {final} to {getattr(commit, 'commit_url', None) or args.push_to_hub}")
    return 0
