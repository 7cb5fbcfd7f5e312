"""`attention_step.attend` on qwen27b's attention geometry (24 q heads, 4 kv heads, head dim 256), B = 1,
by cache length: one block per q head (MAX_SPLITS = 1) against the positions split into chunks (the
default), each call taking the previous call's output as its q so that calls run one after another as in
a decode step (a concatenate makes the output q's shape; its own time is printed as "glue").

    source .device-kit/b/env.sh && python3 harness/gpu/diag_attend.py
Lines go to stdout, rows to $OUT/attend.json.
"""

import mlx.core as mx
import mlx.nn as nn

from engine.kernels import attention_step
from harness.gpu.results import save_json
from harness.kernel_bench import BenchConfig, serial_us

H, HKV, D, ROPE = 24, 4, 256, 64


class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.scale = H, HKV, D**-0.5
        self.q_norm, self.k_norm = nn.RMSNorm(D, eps=1e-6), nn.RMSNorm(D, eps=1e-6)
        self.q_norm.weight = self.q_norm.weight.astype(mx.bfloat16)
        self.k_norm.weight = self.k_norm.weight.astype(mx.bfloat16)
        self.rope = nn.RoPE(ROPE, base=1e7)


def main():
    attn, cfg, rows = Attn(), BenchConfig(calls=200, repeats=5), []
    fpar = attention_step.float_params(attn)
    q = mx.random.normal((1, 1, H * 2 * D)).astype(mx.bfloat16)
    glue = serial_us(lambda x: mx.concatenate([x[..., : H * D], x[..., : H * D]], axis=-1), q, cfg)
    print(f"glue (concatenate) {glue:.1f} us", flush=True)
    for n in (64, 256, 1024, 4096):
        cap = (n + 255) // 256 * 256
        keys = mx.random.normal((1, HKV, cap, D)).astype(mx.bfloat16)
        values = mx.random.normal((1, HKV, cap, D)).astype(mx.bfloat16)
        mx.eval(keys, values)
        row = {"n": n, "glue_us": glue}
        for label, max_splits in (("one_block_us", 1), ("split_us", 16)):
            attention_step.MAX_SPLITS = max_splits
            apar, s = attention_step.attend_params(n, cap)

            def step(x):
                out = attention_step.attend(attn, x, keys, values, apar, fpar, s)
                return mx.concatenate([out, out], axis=-1)

            row[label] = serial_us(step, q, cfg) - glue
        attention_step.MAX_SPLITS = 16
        row["splits"] = attention_step.splits(n)
        print(f"n {n}: one block a head {row['one_block_us']:.1f} us | {row['splits']} chunks {row['split_us']:.1f} us",
              flush=True)
        rows.append(row)
        save_json("attend.json", rows)


if __name__ == "__main__":
    main()
