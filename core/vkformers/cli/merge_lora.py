"""``vkformers merge-lora``: fold a PEFT LoRA adapter into its base model and save the merged model."""
from __future__ import annotations

from pathlib import Path

from vkformers.cli.train import copy_tokenizer_files
from vkformers.models.loading import AutoModelForCausalLM, save_pretrained
from vkformers.models.lora import check_adapter_folder, load_adapter, merge_lora, resolve_adapter


def add_parser(subparsers):
    p = subparsers.add_parser("merge-lora", help="merge a LoRA adapter into its base model",
                              description="W += scaling * B @ A for every adapted layer; modules_to_save replace "
                                          "the base's. The result loads in transformers without peft.")
    p.add_argument("--model", required=True, help="base model folder or hub repo id")
    p.add_argument("--adapter", required=True, metavar="DIR_OR_REPO",
                   help="folder or hub repo id with adapter_config.json and adapter_model.safetensors (or .bin)")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.add_argument("--dtype", default="auto", help="dtype of the saved weights (default: the base model's)")
    p.set_defaults(func=run)
    return p


def run(args) -> int:
    adapter = resolve_adapter(args.adapter)  # fetched (a hub repo id) and checked before the model loads
    check_adapter_folder(adapter)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=args.dtype, requires_grad=False)
    merge_lora(load_adapter(model, adapter))
    save_pretrained(model, args.out)
    copy_tokenizer_files(args.model, args.out)
    print(f"merged {args.adapter} into {args.model}: {args.out}")
    return 0
