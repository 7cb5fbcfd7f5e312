"""In-process benchmarks: `harness native`, `batch-bench`, `server-overhead`, `startup` and `spec`."""
