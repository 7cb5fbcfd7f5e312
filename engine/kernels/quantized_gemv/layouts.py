"""Staged GEMV layouts by row count: a setting (`KernelConfig.staged_layouts`, ENGINE_STAGED_LAYOUT) that lays the
staged kernel's launches (2-64 rows, `staged.staged_config`) out otherwise for chosen row counts, as `tools.gpu.
step_kernels --staged` tries them: warps, row tiles, chunks, stages, K's split, blocks an SM, m groups and the
weights' arithmetic (RW) and the row blocks a block takes in turn (NR)."""

from __future__ import annotations

from dataclasses import dataclass

# A layout's keys (`StagedLayout.parse`) and the StagedConfig fields they set; KS (`split_values`) is the most k
# values a split adds, in place of SPLIT_K_VALUES.
LAYOUT_KEYS = {
    "W": "warps",
    "RT": "row_tiles",
    "CK": "chunk_tiles",
    "ST": "stages",
    "S": "splits",
    "MINB": "min_blocks",
    "MG": "m_groups",
    "RW": "rounded",
    "KS": "split_values",
    "NR": "row_blocks",
}


@dataclass(frozen=True)
class StagedLayout:
    """Staged launches laid out otherwise than `staged_config` chooses: StagedConfig fields (`LAYOUT_KEYS`' values)
    for the launches of these row counts (None: every count); K is split as `splits` chooses unless S is given."""

    rows: frozenset[int] | None
    fields: tuple[tuple[str, int], ...]

    @classmethod
    def parse(cls, item: str) -> StagedLayout:
        """'[ROWS:]KEY=VALUE,...' (e.g. '32,64:RW=1,W=4'); ValueError otherwise."""
        rows, _, body = item.strip().rpartition(":")
        fields = {}
        for pair in filter(None, (v.strip() for v in body.split(","))):
            key, _, value = pair.partition("=")
            if key.strip().upper() not in LAYOUT_KEYS or not value.strip().isdigit():
                raise ValueError(f"staged layout {item!r}: KEY=VALUE items with KEY one of {', '.join(LAYOUT_KEYS)}")
            fields[LAYOUT_KEYS[key.strip().upper()]] = int(value)
        counts = [r.strip() for r in rows.split(",")] if rows else None
        if counts is not None and not all(c.isdigit() and 1 <= int(c) <= 64 for c in counts):
            raise ValueError(f"staged layout {item!r}: ROWS are row counts up to 64, comma-separated")
        return cls(frozenset(map(int, counts)) if counts else None, tuple(sorted(fields.items())))

    def text(self) -> str:
        """The layout as `parse` reads it."""
        names = {field: key for key, field in LAYOUT_KEYS.items()}
        body = ",".join(f"{names[f]}={v}" for f, v in self.fields)
        return f"{','.join(map(str, sorted(self.rows)))}:{body}" if self.rows else body


@dataclass(frozen=True)
class StagedLayouts:
    """Layouts in order: a launch of M rows takes the first that names M or every count (one value, not a tuple, so
    a module holding it keeps it as an attribute, not a child)."""

    items: tuple[StagedLayout, ...] = ()

    @classmethod
    def parse(cls, text: str) -> StagedLayouts:
        """Layouts (`StagedLayout.parse`) separated by ';' (e.g. '32,64:RW=1;16:ST=3'); ValueError otherwise."""
        return cls(tuple(StagedLayout.parse(item) for item in text.split(";") if item.strip()))

    def text(self) -> str:
        return ";".join(layout.text() for layout in self.items)

    def fields(self, m: int) -> dict[str, int]:
        """The StagedConfig fields a launch of M rows takes ({}: none)."""
        return next((dict(lay.fields) for lay in self.items if lay.rows is None or m in lay.rows), {})


NO_LAYOUTS = StagedLayouts()
