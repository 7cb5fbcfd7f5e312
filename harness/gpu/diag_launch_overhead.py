"""Fixed cost of one kernel launch inside an evaluation, per kind of kernel: on tiny inputs the time per
call is all overhead. The GEMV kernel's time per matrix on qwen27b is ~16 us above bytes / peak rate
(reports/gpu/kernels-qwen27b.json); this says how much of that any custom kernel pays.

    source .device-kit/b/env.sh && python3 harness/gpu/diag_launch_overhead.py
"""

import mlx.core as mx

from engine.kernels.quantized_gemv import quantized_matmul
from harness.kernel_bench import BenchConfig, random_quantized, time_us

cfg = BenchConfig(calls=50, repeats=7, cold_bytes=0)
trivial = mx.fast.cuda_kernel(
    name="engine_trivial", input_names=["a"], output_names=["out"],
    source="if (threadIdx.x == 0 && blockIdx.x == 0) out[0] = a[0];",
)
a = mx.ones((16,), dtype=mx.float32)
w, s, b = random_quantized(16, 512, 4, 64)
x = mx.random.normal((1, 512)).astype(mx.bfloat16)
mx.eval(a, w, s, b, x)
rows = {
    "mx.add (16 floats)": lambda: a + 1,
    "trivial cuda_kernel (1 block)": lambda: trivial(inputs=[a], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                                                     output_shapes=[(16,)], output_dtypes=[mx.float32])[0],
    "mx.quantized_matmul 16x512 M=1": lambda: mx.quantized_matmul(x, w, s, b, transpose=True, group_size=64, bits=4),
    "our GEMV 16x512 M=1": lambda: quantized_matmul(x, w, s, b, 64, 4),
}
compiled = mx.compile(lambda x, w, s, b: quantized_matmul(x, w, s, b, 64, 4))
rows["our GEMV 16x512 M=1, compiled"] = lambda: compiled(x, w, s, b)
for name, fn in rows.items():
    print(f"{name}: {time_us(fn, cfg):.1f} us per call evaluated, {time_us(fn, cfg, include_build=True):.1f} built "
          "and evaluated", flush=True)
