"""Work a GEMV launch does around its products, which would otherwise be launches of their own.

Each stage is CUDA text that fills a marked place of the kernel's body
(`source.kernel_source`): what a block's activations are, what it stores for
each output row, and how each row's sum is scaled. The stages on the block's
own output rows cost nothing a k-tile; those are the default
(`DEFAULT_FUSION`, docs/kernels.md).
"""

from __future__ import annotations

from dataclasses import dataclass

_NO_ROW_SCALE = "  auto row_scale = [&](const int) { return 1.0f; };\n"

# Fusion.prenormed: x is already the norm's activations (times its weight), and the producing launch left the
# sums of squares of the norm's input in P blocks' parts (`Fusion.norm_out`). The block copies the parts to
# shared memory with cp.async before its first weight load (`_PRENORMED_PREFETCH`: the copy holds no
# registers over the loop), so they are there by the end; parts too many for 8 KB of shared memory (at many
# rows) are read from global memory instead. Each row's parts are then added by TPR threads (a warp's worth
# per row at M <= W, fewer from there so that all rows are taken at once; lane-strided, then a butterfly), in
# an order fixed by M, before _REDUCE's barrier.
_PRENORMED_PREFETCH = r"""
  constexpr bool PREFETCH = M * P <= 2048;
  __shared__ float ssq_parts[PREFETCH ? M * P : 1];
  for (int i = threadIdx.x; PREFETCH && i < M * P; i += THREADS) {
    const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(ssq_parts + i));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" :: "r"(dst), "l"(ssq_in + i) : "memory");
  }
  asm volatile("cp.async.commit_group;" ::: "memory");
"""
_PRENORMED_REDUCE = r"""
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();
  __shared__ float rscale[M];
  {
    constexpr int FIT = THREADS / M;  // threads a row could take, all rows at once
    constexpr int TPR = FIT >= 32 ? 32 : FIT >= 16 ? 16 : FIT >= 8 ? 8 : FIT >= 4 ? 4 : FIT >= 2 ? 2 : 1;
    const int sub = threadIdx.x % TPR;
    for (int m0 = 0; m0 < M; m0 += THREADS / TPR) {  // every thread goes round as often: the shuffles stay whole
      const int m = m0 + threadIdx.x / TPR;
      float s = 0.0f;
      if (m < M)
        #pragma unroll 4
        for (int p = sub; p < P; p += TPR) s += PREFETCH ? ssq_parts[m * P + p] : ssq_in[m * P + p];
      #pragma unroll
      for (int o = TPR / 2; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
      if (sub == 0 && m < M) rscale[m] = rsqrtf(s / K + __int_as_float(EPS));
    }
  }
  auto row_scale = [&](const int m) { return rscale[m]; };
"""

# Fusion.norm_out: besides its rows of the residual stream, the launch writes them times the next norm's weight
# (hw, bf16) and its part of each row's sum of squares (ssq_out [M, blocks]: its rows' squares added in row
# order), so the next launch takes the norm without a launch of its own or any work a k-tile (`prenormed`).
_NORM_OUT_PROLOGUE = r"""
  for (int i = threadIdx.x; i < WR * 16 * RTO * M; i += THREADS) sq[i / M][i % M] = 0.0f;
"""
_NORM_OUT_AFTER = r"""
  __syncthreads();
  for (int m = threadIdx.x; m < M; m += THREADS) {
    float s = 0.0f;
    for (int rb = 0; rb < WR * 16 * RTO; ++rb) s += sq[rb][m];
    ssq_out[(size_t)m * gridDim.x + blockIdx.x] = s;
  }
"""

# Fusion.norm_scale: the four lanes of a row (t = 0..3) hold its sums of squares over their k values; the
# warps' totals go through shared memory (written before _REDUCE's barrier), so row m's scale is
# rsqrt(sum over the first row group's warps, which split K / K + eps).
_NORM_SCALE_REDUCE = r"""
  static_assert(WM == 1, "norm_scale gathers each row's squares in the warps that hold all its rows");
  __shared__ float ssr[W][8 * NB];
  #pragma unroll
  for (int nb = 0; nb < NB; ++nb) {
    float s = ssq[nb];
    s += __shfl_xor_sync(0xffffffffu, s, 1);
    s += __shfl_xor_sync(0xffffffffu, s, 2);
    if (t == 0) ssr[warp][g + 8 * nb] = s;
  }
  auto row_scale = [&](const int m) {
    float s = 0.0f;
    #pragma unroll
    for (int ww = 0; ww < WK; ++ww) s += ssr[ww][m];
    return rsqrtf(s / K + __int_as_float(EPS));
  };
"""


@dataclass(frozen=True)
class Fusion:
    """The stages of one launch.

    - `residual`: one matrix, whose output is added to `residual` (input);
    - `gated`: two matrices, an MLP's gate and up projections, and one output, silu(gate) * up;
    - `norm_scale`: x is the residual stream and the products are of x times the RMS norm's weight (input
      `norm_w`; template EPS), each row's sums then scaled by rsqrt(mean(x^2) + eps), its sum of squares
      gathered from the activations the block loads anyway (adds work to every k-tile; off by default);
    - `norm_out` (with `residual`): the RMS norm of the launch's output taken for the next launch: it also
      writes its output times the next norm's weight (input `next_norm_w`; output `hw`) and each block's
      part of the output rows' sums of squares (output `ssq_out`);
    - `prenormed`: that next launch: x is `hw`, and each row's sums are scaled by rsqrt(sum of the parts
      (input `ssq_in`) / K + eps) as with `norm_scale`.
    """

    residual: bool = False
    gated: bool = False
    norm_scale: bool = False
    norm_out: bool = False
    prenormed: bool = False

    @classmethod
    def of(cls, residual=None, gated: bool = False, norm_scale: bool = False, norm_out=None, prenormed=None) -> Fusion:
        """The stages `calls.quantized_matmuls`' arguments ask for (None: not asked)."""
        return cls(residual is not None, gated, norm_scale, norm_out is not None, prenormed is not None)

    def inputs(self) -> list[str]:
        return (
            ["norm_w"] * self.norm_scale
            + ["residual"] * self.residual
            + ["next_norm_w"] * self.norm_out
            + ["ssq_in"] * self.prenormed
        )

    @classmethod
    def parse(cls, text: str) -> Fusion:
        """Stages by name, comma-separated ('none' or '' for none), as ENGINE_FUSE gives them."""
        names = {n.strip() for n in text.split(",")} - {"", "none"}
        unknown = names - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(
                f"unknown GEMV stages {sorted(unknown)} (choose from {', '.join(cls.__dataclass_fields__)})"
            )
        if "prenormed" in names:
            raise ValueError("prenormed is the launch norm_out hands the norm to: name norm_out")
        return cls(**{n: True for n in names})

    def names(self) -> str:
        """The stages that are on, comma-separated ('none' when none): what `parse` reads."""
        return ",".join(n for n in self.__dataclass_fields__ if getattr(self, n)) or "none"

    def tag(self) -> str:
        return (
            "_r" * self.residual
            + "_g" * self.gated
            + "_ns" * self.norm_scale
            + "_no" * self.norm_out
            + "_pn" * self.prenormed
        )

    def source(self) -> str:
        """The body's `activations(index, row)` (8 activation values from x[index]), `store` and
        `output(sum, up sum, index)`, and the stages' prologue."""
        lines = [_PRENORMED_PREFETCH] if self.prenormed else []
        if self.norm_scale:  # each thread's sum of squares of the activations it loads, per row block
            lines.append("  float ssq[NB];\n  #pragma unroll\n  for (int nb = 0; nb < NB; ++nb) ssq[nb] = 0.0f;")
        lines.append("  auto activations = [&](const size_t i, const int m) -> uint4 {")
        lines.append("    uint4 v = __ldg(reinterpret_cast<const uint4*>(x + i));")
        if self.norm_scale:  # row m = g + 8 * nb
            lines.append("    const uint4 w8 = __ldg(reinterpret_cast<const uint4*>(norm_w + i % K));")
            lines.append("    ssq[m >> 3] = engine_sumsq8(v, ssq[m >> 3]);")
            lines.append(
                "    v = make_uint4(engine_mul2(v.x, w8.x), engine_mul2(v.y, w8.y), engine_mul2(v.z, w8.z), "
                "engine_mul2(v.w, w8.w));"
            )
        lines.append("    return v;\n  };")
        if self.norm_out:  # each output row also times the next norm's weight, its square kept for the block's sum
            lines.append("  __shared__ float sq[WR * 16 * RTO][M + 1];")
            lines.append(
                "  auto store = [&](const int rb, const int m, const int row, const __nv_bfloat16 o) {\n"
                "    out[(size_t)m * N + row] = o;\n    const float f = __bfloat162float(o);\n"
                "    hw[(size_t)m * N + row] = __float2bfloat16(f * __bfloat162float(next_norm_w[row]));\n"
                "    sq[rb][m] = f * f;\n  };"
            )
        else:
            lines.append(
                "  auto store = [&](const int, const int m, const int row, const __nv_bfloat16 o) "
                "{ out[(size_t)m * N + row] = o; };"
            )
        if self.residual:  # the product rounded to bf16, then added to the residual and rounded: as two ops
            lines.append(
                "  auto output = [&](const float v, const float, const size_t i) {\n    return __float2bfloat16("
                "__bfloat162float(residual[i]) + __bfloat162float(__float2bfloat16(v)));\n  };"
            )
        elif self.gated:  # gate and up rounded to bf16 as their own launches give them, then as engine_swiglu2
            lines.append(
                "  auto output = [&](const float v, const float v_up, const size_t) {\n"
                "    const float gate = __bfloat162float(__float2bfloat16(v)), up = __bfloat162float(__float2bfloat16(v_up));\n"
                "    return __float2bfloat16(engine_silu_bf16(gate) * up);\n  };"
            )
        else:
            lines.append(
                "  auto output = [&](const float v, const float, const size_t) { return __float2bfloat16(v); };"
            )
        return "\n".join(lines) + "\n"

    def row_scale_source(self) -> str:
        """The body's `row_scale(row)` (what each output row's sum is multiplied by), then norm_out's setup."""
        scale = _NORM_SCALE_REDUCE if self.norm_scale else _PRENORMED_REDUCE if self.prenormed else _NO_ROW_SCALE
        return scale + _NORM_OUT_PROLOGUE * self.norm_out

    def after_stores_source(self) -> str:
        return _NORM_OUT_AFTER * self.norm_out


# The stages a fast-tier decode step runs (docs/kernels.md, "Fused stages"): the residual adds in the output
# projections' launches, the SwiGLU in the gate+up launch, and each RMS norm taken by the launch before it.
DEFAULT_FUSION = Fusion(residual=True, gated=True, norm_out=True)
