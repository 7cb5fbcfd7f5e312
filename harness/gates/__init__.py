"""The gates: `harness parity` (our logits against mlx-lm's) and `harness quality` (perplexity and KL)."""
