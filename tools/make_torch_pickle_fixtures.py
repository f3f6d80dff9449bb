"""Write tests/fixtures/torch_pickle/: PyTorch checkpoints as ``torch.save`` writes them, for
tests/test_torch_pickle.py (vkformers reads them without torch, models/torch_pickle.py). Needs torch, transformers,
safetensors and sentence-transformers (no network); the files are made from the tiny fixtures already in the repo:

    llama_tied/           the llama fixture's weights with tie_word_embeddings: config.json and pytorch_model.bin
                          (model.state_dict(): lm_head.weight and model.embed_tokens.weight share one storage), as
                          transformers 4 saved with safe_serialization=False
    llama_sharded_bf16/   the llama fixture's config and its weights in bfloat16: two shards and
                          pytorch_model.bin.index.json
    tensors.pt            a state dict of views (a transpose, slices with storage offsets), every dtype a state
                          dict holds (float8 included), a scalar, an empty tensor and an nn.Parameter;
    tensors.safetensors   the same tensors, contiguous, written by safetensors: what tensors.pt must read as
    bert/pytorch_model.bin  the cross_encoder/bert-reranker fixture's BertModel, as a sentence-transformers
                          Transformer module saves it (no "bert." prefix, no classifier)
    dense/                a sentence-transformers Dense(32 -> 8) saved with safe_serialization=False;
    dense.safetensors     the same module saved with safetensors
    llama_lora/           the llama_lora fixture's PEFT adapter as PEFT < 0.4 saved it: adapter_config.json and
                          adapter_model.bin (torch.save of get_peft_model_state_dict, the keys of
                          adapter_model.safetensors)

Each checkpoint is loaded back with torch.load(weights_only=True) / transformers and checked against its source.
Deterministic: re-running with the same torch gives byte-identical files.

    /tmp/tfvenv/bin/python tools/make_torch_pickle_fixtures.py
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from sentence_transformers.sentence_transformer.modules import Dense
from peft import PeftModel, get_peft_model_state_dict
from transformers import AutoConfig, BertModel, LlamaForCausalLM

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures"
OUT = FIXTURES / "torch_pickle"
IDS = torch.tensor([[1, 5, 9, 2, 7]])


def llama_tied():
    config = AutoConfig.from_pretrained(FIXTURES / "llama")
    config.tie_word_embeddings = True
    untied = LlamaForCausalLM.from_pretrained(FIXTURES / "llama")
    model = LlamaForCausalLM(config).eval()
    state = {k: v for k, v in untied.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state, strict=False)
    folder = OUT / "llama_tied"
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    saved = model.state_dict()
    assert saved["lm_head.weight"].data_ptr() == saved["model.embed_tokens.weight"].data_ptr()
    torch.save(saved, folder / "pytorch_model.bin")
    again = LlamaForCausalLM.from_pretrained(folder).eval()
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def llama_sharded_bf16():
    model = LlamaForCausalLM.from_pretrained(FIXTURES / "llama").eval()
    state = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
    names = sorted(state)
    folder = OUT / "llama_sharded_bf16"
    folder.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for i, part in enumerate((names[::2], names[1::2]), 1):
        file = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({n: state[n] for n in part}, folder / file)
        weight_map.update({n: file for n in part})
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n")
    shutil.copy(FIXTURES / "llama" / "config.json", folder)
    again = LlamaForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    assert all(torch.equal(again.state_dict()[n], state[n]) for n in names)


def tensors():
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(4, 6, generator=generator)
    state = {
        "weight": weight,
        "transposed": weight.t(),            # the same storage, strides (1, 6)
        "rows": weight[1:3],                 # storage offset 6
        "column": weight[:, 2],              # offset 2, stride 6
        "half": torch.randn(3, 5, generator=generator).half(),
        "bfloat16": torch.tensor([[1.5, -2.25, float("inf")], [3.0e38, 1e-40, float("nan")]]).bfloat16(),
        "double": torch.randn(2, 2, generator=generator, dtype=torch.float64),
        "long": torch.tensor([-(2 ** 40), 0, 7, 2 ** 62]),
        "int": torch.tensor([-5, 2 ** 30], dtype=torch.int32),
        "short": torch.tensor([-300, 300], dtype=torch.int16),
        "char": torch.tensor([-128, 127], dtype=torch.int8),
        "byte": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "float8": torch.tensor([0.5, -448.0, 3.0]).to(torch.float8_e4m3fn),   # torch's _rebuild_tensor_v3
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 3),
        "parameter": torch.nn.Parameter(torch.arange(3.0)),
    }
    torch.save(state, OUT / "tensors.pt")
    save_file({k: v.detach().contiguous().clone() for k, v in state.items()}, OUT / "tensors.safetensors")
    loaded = torch.load(OUT / "tensors.pt", weights_only=True)
    assert all(torch.equal(loaded[k].float(), v.detach().float()) or k == "bfloat16" for k, v in state.items())


def bert():
    model = BertModel.from_pretrained(FIXTURES / "cross_encoder" / "bert-reranker").eval()
    (OUT / "bert").mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), OUT / "bert" / "pytorch_model.bin")
    loaded = torch.load(OUT / "bert" / "pytorch_model.bin", weights_only=True)
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())


def dense():
    torch.manual_seed(0)
    module = Dense(32, 8, activation_function=torch.nn.Tanh())
    (OUT / "dense").mkdir()
    (OUT / "dense_safetensors").mkdir()
    module.save(str(OUT / "dense"), safe_serialization=False)
    module.save(str(OUT / "dense_safetensors"), safe_serialization=True)
    shutil.move(OUT / "dense_safetensors" / "model.safetensors", OUT / "dense.safetensors")
    shutil.rmtree(OUT / "dense_safetensors")


def llama_lora():
    """PEFT < 0.4's save_pretrained: torch.save(get_peft_model_state_dict(model), "adapter_model.bin")."""
    source = FIXTURES / "llama_lora"
    model = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(FIXTURES / "llama"), source).eval()
    state = get_peft_model_state_dict(model)
    safe = load_file(source / "adapter_model.safetensors")
    assert sorted(state) == sorted(safe) and all(torch.equal(state[k], safe[k]) for k in safe)
    folder = OUT / "llama_lora"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(source / "adapter_config.json", folder)
    torch.save(state, folder / "adapter_model.bin")
    # PEFT still reads a folder with adapter_model.bin only, to the same logits
    again = PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(FIXTURES / "llama"), folder).eval()
    with torch.no_grad():
        assert torch.equal(again(IDS).logits, model(IDS).logits)


def main():
    torch.set_num_threads(1)
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    for make in (llama_tied, llama_sharded_bf16, tensors, bert, dense, llama_lora):
        make()
    files = sorted(p for p in OUT.rglob("*") if p.is_file())
    for path in files:
        print(f"{path.stat().st_size:8d}  {path.relative_to(OUT)}")
    print(f"{sum(p.stat().st_size for p in files):8d}  in all")


if __name__ == "__main__":
    main()
