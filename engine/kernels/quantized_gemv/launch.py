"""How a GEMV call is laid out on the GPU: warps a block, row tiles a block, k-tiles a load batch.

The shapes were timed on an H200 for qwen27b's matrices with the weights
cold (docs/kernels.md, "Launch shapes"); `launch_config` is that table, and
a `KernelConfig`'s one-row launch shapes replace it for given matrix sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from engine.kernels.quantized_gemv.fusion import Fusion
from engine.kernels.quantized_gemv.source import kernel


def tile_k(group_size: int, bits: int) -> int:
    """Input values one k-tile covers: 4 lanes x 1-2 words, inside one group."""
    return 4 * min(group_size * bits // 128, 2) * (32 // bits)


LAUNCH_FORM = "W,RT,U[,MINB] (warps 1-32)"  # a one-row launch shape as a setting gives it


@dataclass(frozen=True)
class LaunchConfig:
    """How one call is laid out on the GPU."""

    warps: int  # warps of a block: `row_groups` groups, each group's warps splitting K
    row_tiles: int  # 16-row tiles per row group
    batch: int  # k-tiles per load batch (U)
    # Blocks an SM must hold at once (0: as many as the registers allow): caps the registers a thread uses,
    # so that a launch's blocks take fewer waves (docs/kernels.md, "The register cap").
    min_blocks: int = 0
    row_groups: int = 1  # groups of warps a block on their own rows (WR), sharing the activations' loads
    m_groups: int = 1  # slices of the activation rows a row group's warps split (WM), each loading the weights

    @classmethod
    def parse(cls, text: str) -> LaunchConfig:
        """LAUNCH_FORM's shape (one row group); ValueError otherwise."""
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not 3 <= len(values) <= 4 or min(values[:3]) < 1 or not 1 <= values[0] <= 32 or min(values) < 0:
            raise ValueError(f"{text!r} is not {LAUNCH_FORM}")
        return cls(*values)

    def template(self) -> list[tuple[str, int]]:
        # MINB only names the kernel apart (MLX caches compiled kernels by name and template values).
        return [
            ("W", self.warps),
            ("RT", self.row_tiles),
            ("U", self.batch),
            ("WR", self.row_groups),
            ("WM", self.m_groups),
        ] + ([("MINB", self.min_blocks)] if self.min_blocks else [])

    def kernel(self, count: int, fusion: Fusion = Fusion()):
        return kernel(count, self.warps * 32 if self.min_blocks else 0, self.min_blocks, fusion)

    def setting(self) -> str:
        """'W,RT,U[,MINB]', as an ENGINE_GEMV_LAUNCH item gives it (`parse_launches`; one row group)."""
        return ",".join(map(str, [self.warps, self.row_tiles, self.batch] + [self.min_blocks] * bool(self.min_blocks)))


Launches = Mapping[tuple[int, int], LaunchConfig]  # one-row launch shapes by (rows of all matrices, K)


def parse_launches(text: str) -> dict[tuple[int, int], LaunchConfig]:
    """ENGINE_GEMV_LAUNCH's form, 'ROWSxK=W,RT,U[,MINB];...', as {(rows, k): config}."""
    table = {}
    for item in filter(None, (part.strip() for part in text.split(";"))):
        try:
            shape, _, numbers = item.partition("=")
            rows, k = (int(v) for v in shape.lower().split("x"))
            config = LaunchConfig.parse(numbers)
        except ValueError:
            raise ValueError(f"ENGINE_GEMV_LAUNCH: {item!r} is not ROWSxK={LAUNCH_FORM}") from None
        table[(rows, k)] = config
    return table


def launches_setting(launches: Launches) -> str:
    """`parse_launches`' form of a table ('' for none)."""
    return ";".join(f"{rows}x{k}={c.setting()}" for (rows, k), c in launches.items())


def launch_config(m: int, k: int, group_size: int, bits: int, rows: int = 0, launches: Launches = {}) -> LaunchConfig:
    """The launch for M rows against K inputs and `rows` outputs in all the launch's matrices. One row from 64
    k-tiles: up to 8192 rows (8, 1, 4), larger (4, 1, 4), and from 32 MB of 4-bit weights (4, 2, 4) at five
    blocks an SM; M = 8 (4, 2, 4) for K = 17408 and (4, 2, 8) for K = 5120 (docs/kernels.md, "Launch
    shapes"). From 9 rows, row groups of 16 rows (`LaunchConfig.row_groups`): 4 a block from 12288 output
    rows, else 2, each group's K split over 2 warps from K > 5120, else 1, so that how a matrix's sums run
    depends on K, not on the matrices it shares a launch with; from 17 rows the group's warps also split
    the activation rows in 4 (`LaunchConfig.m_groups`; registers capped for one block an SM). From 33 rows
    no warp splits K (each adds every k-tile of its rows): from 12288 output rows 2 groups on 4 row tiles,
    each splitting the activation rows in 2, else one group on 2 row tiles in 4 slices, whose sums' staging
    leaves room for norm_out's (docs/kernels.md, "Batched rows").
    `launches` replaces the one-row choice for given (rows, K)."""
    if m == 1 and (rows, k) in launches:
        return launches[(rows, k)]
    if m > 32:  # no K split: each warp adds every k-tile of its rows
        if rows >= 12288:
            return LaunchConfig(4, 4, 1, 2, row_groups=2, m_groups=2)
        return LaunchConfig(4, 2, 2, 4, m_groups=4)
    if m > 8:
        groups, split, slices = 4 if rows >= 12288 else 2, 2 if k > 5120 else 1, 1 if m <= 16 else 4
        return LaunchConfig(
            groups * split * slices, 1, 4, min_blocks=int(slices > 1), row_groups=groups, m_groups=slices
        )
    tiles = k // tile_k(group_size, bits)
    if tiles >= 64 and m == 1:
        if rows <= 8192:  # at most 3 blocks an SM for K from 12288: one wave, not 1.21 (registers 94 -> 61)
            return LaunchConfig(8, 1, 4, 3 if k >= 12288 else 0)
        return LaunchConfig(4, 2, 4, 5) if rows * k >= 64 << 20 else LaunchConfig(4, 1, 4)
    if tiles >= 256:
        return LaunchConfig(2, 1, 4) if m <= 4 else LaunchConfig(4, 2, 4)
    if tiles >= 64:
        return LaunchConfig(4, 2, 4) if m <= 4 else LaunchConfig(4, 2, 8)
    return LaunchConfig(2 if tiles >= 16 else 1, 1, 4)
