"""One torch.optim.AdamW step (lr 1e-2, betas (0.9, 0.999), eps 1e-8, weight decay 0.01) from the fixtures'
gradients gives the fixtures' parameters (transformers + torch, tests/fixtures/README.md) within 1e-5."""
import json

import numpy as np
import pytest

import vkformers as vkf
from fixture_cases import read_reference
from test_decoder_parity import FIXTURES, fixture_names, _unsupported_reason
from vkformers.models.loading import AutoModelForCausalLM
from vkformers.optim import AdamW

RUNNABLE = [n for n in fixture_names() if _unsupported_reason(FIXTURES / n) is None]


@pytest.mark.parametrize("name", RUNNABLE)
def test_one_adamw_step_matches_torch(name):
    folder = FIXTURES / name
    reference = read_reference(folder / "reference.safetensors")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype="float32")
    params = dict(model.named_parameters())
    meta = json.loads((folder / "meta.json").read_text())
    # transformers renames a few parameters on save (GPT-NeoX lm_head -> embed_out): the fixture uses
    # the in-memory names, we use the saved ones.
    saved_as = dict(zip(sorted(meta.get("parameters_not_saved", [])), sorted(meta.get("saved_keys_not_parameters", []))))
    ours = {ref_name: params[saved_as.get(ref_name, ref_name)]
            for ref_name in (k[len("grad."):] for k in reference if k.startswith("grad."))}
    assert len(ours) == len(params)
    without_grad = set(meta.get("params_without_grad", []))  # torch's AdamW skips them (no decay either)
    for ref_name, p in ours.items():
        p.grad = None if ref_name in without_grad else vkf.tensor(reference[f"grad.{ref_name}"])
    AdamW(list(ours.values()), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01).step()
    for ref_name, p in ours.items():
        np.testing.assert_allclose(p.numpy(), reference[f"adamw.{ref_name}"], atol=1e-5, rtol=0, err_msg=ref_name)
