"""Training: the loop (one recorded submission per step), LoRA in PEFT's format, checkpoints, data.

    from vkformers.training import Trainer, TrainingConfig, load_dataset, Batches
    data = load_dataset(["corpus.txt"], tokenizer, seq_len=128)
    train, held_out = data.split(0.05)
    trainer = Trainer(model, TrainingConfig(steps=500, lr=1e-3), Batches(train, 8, seed=0),
                      eval_batches=fixed_batches(held_out, 8), out_dir="run")
    trainer.train()
"""
from vkformers.training.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from vkformers.training.data import (Batches, ByteTokenizer, DataError, PackedDataset, fixed_batches,
                                     hf_dataset_files, load_dataset, load_tokenizer, read_records, tokenize_records)
# re-exported: a training API too; get_peft_model and PeftModel are PEFT's names for apply_lora and load_adapter
from vkformers.models.lora import (LoraConfig, PeftModel, apply_lora, get_peft_model, load_adapter, merge_lora,
                                   save_adapter)
from vkformers.training.schedules import learning_rate, lr_factor
from vkformers.training.trainer import (LossScaler, NonFiniteLossError, StepResult, Trainer, TrainingConfig,
                                        init_weights)

__all__ = ["Batches", "ByteTokenizer", "DataError", "LoraConfig", "LossScaler", "NonFiniteLossError",
           "PackedDataset", "PeftModel", "get_peft_model", "StepResult", "Trainer", "TrainingConfig", "apply_lora", "fixed_batches",
           "hf_dataset_files", "init_weights", "latest_checkpoint", "learning_rate", "load_adapter",
           "load_checkpoint", "load_dataset", "load_tokenizer", "lr_factor", "merge_lora", "read_records",
           "save_adapter", "save_checkpoint", "tokenize_records"]
