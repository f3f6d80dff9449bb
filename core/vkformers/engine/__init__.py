"""The engine: tensors, ops (forward, backward, kernel) and autograd, recorded into replayable sequences.

Imports run downward: lazy (graph, realization) <- function (KernelOp, Function, autograd state) <- quantized
<- ops/* <- tensor (Tensor and its operators) <- functional. Ops and Functions make tensors only through the
factories tensor.py registers in function.py (``wrap``, ``constant``), so nothing below tensor.py imports it.
"""
