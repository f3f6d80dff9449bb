"""vkformers-bert: bidirectional encoders (BERT, RoBERTa, ModernBERT, ...)."""
