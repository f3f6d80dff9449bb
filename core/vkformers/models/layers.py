"""The layers models are built from, with Hugging Face parameter names (weight, bias)."""
from __future__ import annotations

from vkformers.engine import functional as F
from vkformers.models.module import Module, is_packed


class Linear(Module):
    """y = x @ weight.T + bias, weight [out_features, in_features] as in HF checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.param("weight", (out_features, in_features), row_blocks=True)  # F.linear takes row blocks
        if bias:
            self.param("bias", (out_features,))

    @property
    def quantized(self) -> bool:
        """Whether the weight is packed blocks (engine.quantized), which only F.linear's quantized product reads."""
        return is_packed(self.weight)

    def forward(self, x, live_rows=None):
        """``live_rows``: see F.linear (the rows past it are padding a mixture-of-experts expert may skip)."""
        return F.linear(x, self.weight, self.bias if self.has_bias else None, live_rows=live_rows)


class UpdatedLinear(Linear):
    """A Linear whose output is its own product plus :meth:`row_update` of the same input, an update each row of a
    batch may take differently (served LoRA adapters, models/lora.py). A decode step's fused kernels compute the
    update beside them and add it where the bias goes, so that such a layer keeps them."""

    def row_update(self, x):
        """The update to ``x @ weight.T + bias`` ([..., out_features] in x's dtype), or None for none."""
        raise NotImplementedError

    def forward(self, x, live_rows=None):
        y = super().forward(x, live_rows)
        update = self.row_update(x)
        return y if update is None else y + update


def linears_can_be_grouped(linears) -> bool:
    """Whether :func:`grouped_linear` runs these Linear layers (a mixture's experts' projections): no biases, and
    all plain or all with like LoRA adapters (same rank, scaling and dropout)."""
    def kind(linear):
        if not isinstance(linear, Linear) or linear.has_bias or linear.quantized:
            return None
        if hasattr(linear, "lora_A"):  # models.lora.LoraLinear, a Linear subclass (lora imports this module)
            return "lora", linear.r, linear.scaling, linear.dropout
        return "plain" if type(linear) is Linear else None
    kinds = {kind(linear) for linear in linears}
    return len(kinds) == 1 and None not in kinds


def grouped_linear(rows, linears, spans):
    """linears[e] on span e of ``rows`` (F.grouped_matmul: a mixture of experts' token rows packed expert after
    expert), with each layer's LoRA adapter where it has one (as LoraLinear.forward; see
    :func:`linears_can_be_grouped`)."""
    y = F.grouped_matmul(rows, [linear.weight.transpose(0, 1) for linear in linears], spans)
    first = linears[0]
    if not hasattr(first, "lora_A") or first.adapter_disabled:
        return y
    h = F.dropout(rows, first.dropout, training=first.training).float()
    low = F.grouped_matmul(h, [linear.lora_A.weight.transpose(0, 1) for linear in linears], spans)
    update = F.grouped_matmul(low, [linear.lora_B.weight.transpose(0, 1) for linear in linears], spans)
    return y + (update * first.scaling).cast(y.dtype)


class Conv1D(Module):
    """GPT-2's projection: y = x @ weight + bias with weight stored [in_features, out_features] (the transpose
    of Linear's), kept in that layout so checkpoints load and save unchanged."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        self.in_features, self.out_features, self.has_bias = in_features, out_features, bias
        self.param("weight", (in_features, out_features))
        if bias:
            self.param("bias", (out_features,))

    def forward(self, x):
        y = x @ self.weight
        return y + self.bias if self.has_bias else y


class Embedding(Module):
    """A lookup table; ``padding_idx`` as torch.nn.Embedding's (negative counts from the end): lookups of that row
    pass it no gradient."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None = None):
        super().__init__()
        self.padding_idx = padding_idx
        self.param("weight", (num_embeddings, embedding_dim), row_blocks=True)  # so does F.embedding

    def forward(self, ids):
        return F.embedding(ids, self.weight, padding_idx=self.padding_idx)


class RMSNorm(Module):
    """x / rms(x) * weight; ``unit_offset``: * (1 + weight) as Gemma stores it; no weight if ``elementwise=False``."""

    def __init__(self, dim: int, eps: float = 1e-6, unit_offset: bool = False, elementwise: bool = True):
        super().__init__()
        self.eps, self.unit_offset, self.elementwise = eps, unit_offset, elementwise
        if elementwise:
            self.param("weight", (dim,))

    def forward(self, x):
        return F.rms_norm(x, self.weight if self.elementwise else None, eps=self.eps, unit_offset=self.unit_offset)


class LayerNorm(Module):
    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True, elementwise: bool = True):
        super().__init__()
        self.eps, self.has_bias, self.elementwise = eps, bias and elementwise, elementwise
        if elementwise:
            self.param("weight", (dim,))
        if self.has_bias:
            self.param("bias", (dim,))

    def forward(self, x):
        return F.layer_norm(x, self.weight if self.elementwise else None, self.bias if self.has_bias else None,
                            eps=self.eps)


class ModuleList(Module):
    """Children named 0, 1, 2, ... (HF's ``layers.0``)."""

    def __init__(self, modules=()):
        super().__init__()
        self.items = []
        for module in modules:
            self.append(module)

    def append(self, module: Module) -> None:
        self.add(str(len(self.items)), module)
        self.items.append(module)

    def __iter__(self):
        return iter(self.items)

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]
