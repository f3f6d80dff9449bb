"""``vkformers merge-lora``: fold a PEFT LoRA adapter into its base model and save the merged model: a causal LM,
or the task model its PEFT task_type names (SEQ_2_SEQ_LM, SEQ_CLS, TOKEN_CLS, QUESTION_ANS)."""
from __future__ import annotations

from pathlib import Path

from vkformers.cli.train import copy_tokenizer_files
from vkformers.models.hub import create_hub_repo, upload_to_hub
from vkformers.models.loading import (AutoModelForCausalLM, AutoModelForQuestionAnswering, AutoModelForSeq2SeqLM,
                                      AutoModelForSequenceClassification, AutoModelForTokenClassification,
                                      save_pretrained)
from vkformers.models.lora import check_adapter_folder, load_adapter, merge_lora, resolve_adapter

# the model an adapter's PEFT task_type was trained on (transformers' AutoModelFor<Task>)
TASK_MODELS = {"SEQ_2_SEQ_LM": AutoModelForSeq2SeqLM, "SEQ_CLS": AutoModelForSequenceClassification,
               "TOKEN_CLS": AutoModelForTokenClassification, "QUESTION_ANS": AutoModelForQuestionAnswering}


def add_parser(subparsers):
    p = subparsers.add_parser("merge-lora", help="merge a LoRA adapter into its base model",
                              description="W += scaling * B @ A for every adapted layer; modules_to_save replace "
                                          "the base's. The result loads in transformers without peft.")
    p.add_argument("--model", required=True, help="base model folder or hub repo id")
    p.add_argument("--adapter", required=True, metavar="DIR_OR_REPO",
                   help="folder or hub repo id with adapter_config.json and adapter_model.safetensors (or .bin)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--dtype", default="auto", help="dtype of the saved weights (default: the base model's)")
    p.add_argument("--push-to-hub", metavar="ORG/NAME", help="then upload the merged model to this hub repo")
    p.add_argument("--hub-private", action="store_true", help="create the repo private")
    p.add_argument("--hub-token", default=None, help="a token with write access (default: HF_TOKEN or the saved "
                   "login)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    adapter = resolve_adapter(args.adapter)  # fetched (a hub repo id) and checked before the model loads
    config = check_adapter_folder(adapter)
    if args.push_to_hub:  # a wrong repo name or token stops the command before the model loads
        create_hub_repo(args.push_to_hub, private=args.hub_private or None, token=args.hub_token)
    auto = TASK_MODELS.get(config.task_type, AutoModelForCausalLM)
    model = auto.from_pretrained(args.model, dtype=args.dtype, requires_grad=False)
    merge_lora(load_adapter(model, adapter))
    save_pretrained(model, args.out)
    copy_tokenizer_files(args.model, args.out)
    print(f"merged {args.adapter} into {args.model}: {args.out}")
    if args.push_to_hub:
        commit = upload_to_hub(args.out, args.push_to_hub, private=args.hub_private or None, token=args.hub_token,
                               commit_message=f"merge {args.adapter} into {args.model}")
        print(f"pushed {args.out} to {getattr(commit, 'commit_url', None) or args.push_to_hub}")
    return 0
