"""Reference runs of stock mlx-lm (the oracle). Only tests, goldens and the harness import this."""
