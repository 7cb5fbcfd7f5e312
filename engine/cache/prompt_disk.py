"""The prompt cache's disk tier: entries evicted from RAM, and all of them at shutdown, kept in a directory.

Layout: `DIR/<artifact key>/<prefix key>.safetensors` (the arrays) beside
`<prefix key>.json` (the token prefix, each layer's class and plain fields,
the block snapshots' positions, the arrays file's sha256). The artifact key
hashes the model's config and weight files' names and sizes and the KV
scheme, so a restart on the same artifact finds its entries and another
artifact never sees them. Both files are written to temporary names and
renamed, the manifest last: an entry exists once its manifest does, and
concurrent writers of one key each rename a whole file. A read checks the
sha256 and the manifest's fields; a file that fails (corrupt, truncated,
foreign) is removed and counts as a miss, never as a hit. A write that fails
(disk full, no permission) turns the tier off with a warning: the cache goes
on in RAM.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from engine.cache.kv import KVCache
from engine.cache.quantized import QuantizedKVCache
from engine.cache.recurrent import RecurrentCache
from engine.cache.rotating import RotatingKVCache

log = logging.getLogger(__name__)

FORMAT = 1  # bump when the layout changes: older entries then read as foreign and are removed
CLASSES = {c.__name__: c for c in (KVCache, QuantizedKVCache, RecurrentCache, RotatingKVCache)}
PLAIN = (int, float, str, bool, type(None))


def artifact_key(model_dir: Path, kv_scheme: str = "bf16") -> str:
    """What a stored entry must have been made with: the model's config, its weight files' names and sizes,
    the KV scheme and this format."""
    h = hashlib.sha256(f"format {FORMAT}; kv {kv_scheme}\n".encode())
    model_dir = Path(model_dir)
    config = model_dir / "config.json"
    h.update(config.read_bytes() if config.exists() else b"")
    for f in sorted(model_dir.glob("*.safetensors")):
        h.update(f"{f.name} {f.stat().st_size}\n".encode())
    return h.hexdigest()[:32]


def prefix_key(tokens: tuple[int, ...]) -> str:
    return hashlib.sha256(np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:40]


def _layer_fields(layer, name: str, arrays: dict[str, mx.array]) -> dict:
    """A cache layer as its class and plain fields; its arrays go into `arrays` under `name`."""
    if type(layer).__name__ not in CLASSES:
        raise TypeError(f"the disk tier does not store {type(layer).__name__}")
    fields = {}
    for attr, value in vars(layer).items():
        if isinstance(value, mx.array):
            arrays[f"{name}.{attr}"] = value
            fields[attr] = {"array": f"{name}.{attr}"}
        elif isinstance(value, (list, tuple)) and all(v is None or isinstance(v, mx.array) for v in value):
            names = []
            for i, v in enumerate(value):
                if v is not None:
                    arrays[f"{name}.{attr}.{i}"] = v
                names.append(None if v is None else f"{name}.{attr}.{i}")
            fields[attr] = {"arrays": names} | ({"tuple": True} if isinstance(value, tuple) else {})
        elif isinstance(value, PLAIN) or (isinstance(value, list) and all(isinstance(v, PLAIN) for v in value)):
            fields[attr] = {"value": value}
        else:
            raise TypeError(f"the disk tier does not store {type(layer).__name__}.{attr} ({type(value).__name__})")
    return {"class": type(layer).__name__, "fields": fields}


def _layer(spec: dict, arrays: dict[str, mx.array]):
    cls = CLASSES[spec["class"]]
    layer = cls.__new__(cls)
    for attr, f in spec["fields"].items():
        if "array" in f:
            value = arrays[f["array"]]
        elif "arrays" in f:
            value = [None if n is None else arrays[n] for n in f["arrays"]]
            value = tuple(value) if f.get("tuple") else value
        else:
            value = f["value"]
        setattr(layer, attr, value)
    return layer


@dataclass(frozen=True)
class DiskEntry:
    """What the index knows of a stored entry without reading its arrays."""

    key: str
    ids: np.ndarray
    trimmable: bool
    snapshot_at: tuple[int, ...]
    nbytes: int  # of the arrays file


class DiskTier:
    def __init__(self, directory: Path, artifact: str, max_bytes: int):
        if max_bytes < 0:
            raise ValueError(f"the disk tier's max_bytes must be >= 0, got {max_bytes}")
        self.dir = Path(directory) / artifact
        self.max_bytes = max_bytes
        self.entries: dict[str, DiskEntry] = {}  # oldest first
        self.bytes = 0
        self.hits = self.writes = self.dropped = 0
        self.error: str | None = None  # set when the tier turned itself off
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            probe = self.dir / f".probe-{uuid.uuid4().hex}"
            probe.write_bytes(b"")
            probe.unlink()
        except OSError as e:
            self._off(f"cannot write {self.dir}: {e}")
            return
        self._scan()

    @property
    def on(self) -> bool:
        return self.error is None

    def _off(self, why: str) -> None:
        self.error = why
        log.warning("prompt cache disk tier off, RAM only: %s", why)

    def _scan(self) -> None:
        """Index the manifests found (oldest first); unreadable ones and orphaned files are removed."""
        manifests = sorted(self.dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
        for path in manifests:
            try:
                m = json.loads(path.read_text())
                entry = DiskEntry(
                    path.stem,
                    np.asarray(m["tokens"], dtype=np.int64),
                    bool(m["trimmable"]),
                    tuple(int(n) for n in m["snapshot_at"]),
                    int(m["nbytes"]),
                )
                if m.get("format") != FORMAT or prefix_key(tuple(m["tokens"])) != path.stem:
                    raise ValueError("foreign manifest")
            except (OSError, ValueError, KeyError, TypeError) as e:
                log.warning("prompt cache: removing unreadable %s (%s)", path.name, e)
                self._delete(path.stem)
                continue
            self.entries[entry.key] = entry
            self.bytes += entry.nbytes
        known = set(self.entries)
        for path in self.dir.glob("*.safetensors"):
            if path.stem not in known:
                path.unlink(missing_ok=True)
        self._fit()

    def write(self, tokens: tuple[int, ...], cache: list, snapshots: dict[int, list], trimmable: bool) -> bool:
        """Store an entry (replacing one of the same tokens); False when the tier is off or the write failed."""
        if not self.on:
            return False
        key = prefix_key(tokens)
        arrays: dict[str, mx.array] = {}
        try:
            layers = [_layer_fields(c, f"c{i}", arrays) for i, c in enumerate(cache)]
            snaps = {
                str(n): [None if c is None else _layer_fields(c, f"s{n}.{i}", arrays) for i, c in enumerate(ls)]
                for n, ls in snapshots.items()
            }
        except TypeError as e:
            log.info("prompt cache: not stored on disk: %s", e)
            return False
        tmp = f".{key}.{uuid.uuid4().hex}"
        data, manifest = self.dir / f"{key}.safetensors", self.dir / f"{key}.json"
        try:
            mx.save_safetensors(str(self.dir / f"{tmp}.safetensors"), arrays)
            os.replace(self.dir / f"{tmp}.safetensors", data)
            nbytes = data.stat().st_size
            body = {
                "format": FORMAT,
                "tokens": [int(t) for t in tokens],
                "trimmable": trimmable,
                "layers": layers,
                "snapshots": snaps,
                "snapshot_at": sorted(snapshots),
                "nbytes": nbytes,
                "sha256": _sha256(data),
            }
            (self.dir / f"{tmp}.json").write_text(json.dumps(body))
            os.replace(self.dir / f"{tmp}.json", manifest)
        except OSError as e:
            for p in (self.dir / f"{tmp}.safetensors", self.dir / f"{tmp}.json"):
                p.unlink(missing_ok=True)
            self._off(f"writing {data.name} failed: {e}")
            return False
        old = self.entries.pop(key, None)
        if old is not None:
            self.bytes -= old.nbytes
        self.entries[key] = DiskEntry(
            key, np.asarray(tokens, dtype=np.int64), trimmable, tuple(sorted(snapshots)), nbytes
        )
        self.bytes += nbytes
        self.writes += 1
        self._fit()
        return key in self.entries

    def read(self, key: str) -> tuple[list, dict[int, list]] | None:
        """The entry's caches and snapshots, or None (removed) where its files fail their checks."""
        data, manifest = self.dir / f"{key}.safetensors", self.dir / f"{key}.json"
        try:
            m = json.loads(manifest.read_text())
            if m.get("format") != FORMAT or _sha256(data) != m["sha256"]:
                raise ValueError("checksum mismatch")
            arrays = mx.load(str(data))
            cache = [_layer(spec, arrays) for spec in m["layers"]]
            snapshots = {
                int(n): [None if s is None else _layer(s, arrays) for s in ls] for n, ls in m["snapshots"].items()
            }
        except (OSError, ValueError, KeyError, TypeError, RuntimeError) as e:
            log.warning("prompt cache: removing %s, which failed to load (%s)", data.name, e)
            self.remove(key)
            return None
        self.hits += 1
        return cache, snapshots

    def remove(self, key: str) -> None:
        entry = self.entries.pop(key, None)
        if entry is not None:
            self.bytes -= entry.nbytes
        self._delete(key)

    def _delete(self, key: str) -> None:
        for suffix in (".json", ".safetensors"):
            (self.dir / f"{key}{suffix}").unlink(missing_ok=True)

    def _fit(self) -> None:
        while self.bytes > self.max_bytes and self.entries:
            self.remove(next(iter(self.entries)))
            self.dropped += 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
