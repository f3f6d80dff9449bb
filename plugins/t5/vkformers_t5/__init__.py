"""vkformers-t5: encoder-decoders (T5, BART, Marian, Pegasus, ...)."""
