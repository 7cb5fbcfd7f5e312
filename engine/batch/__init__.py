"""Continuous batching: the scheduler decides (no MLX), the runner computes, the batcher drives both."""
