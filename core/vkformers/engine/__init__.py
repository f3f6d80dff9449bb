"""The engine: tensors, ops (forward, backward, kernel) and autograd, recorded into replayable sequences."""
