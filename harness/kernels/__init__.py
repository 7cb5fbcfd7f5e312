"""`harness kernels`: the fast tier's kernels against MLX's operations, and its numerics gate."""
