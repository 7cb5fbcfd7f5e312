"""The trained models' text, which every machine has: the running interpreter's standard library (its source
and docstrings) and the project's corpus, split into train and held-out files by a hash of each file's name.

The standard library differs between Python versions, so a corpus records the version it was read from
and a sha256 over every file's name and text in order: two trainings saw the same text when the hashes
match.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from pathlib import Path

HELD_OUT_EVERY = 20  # one file in this many, by the hash of its name, is held out
DEFAULT_MAX_BYTES = 32 << 20  # text read at most (files in name-hash order, the project's corpus first)


@dataclass(frozen=True)
class TextFile:
    name: str  # "stdlib/json/decoder.py", "engine/synth/corpus.txt"
    text: str


@dataclass(frozen=True)
class Corpus:
    train: tuple[TextFile, ...]
    held_out: tuple[TextFile, ...]
    python: str  # the version whose standard library was read

    @property
    def sha256(self) -> str:
        digest = hashlib.sha256()
        for part, files in (("train", self.train), ("held-out", self.held_out)):
            for f in files:
                digest.update(f"{part}\0{f.name}\0".encode())
                digest.update(f.text.encode())
        return digest.hexdigest()

    def summary(self) -> dict:
        return {
            "python": self.python,
            "sha256": self.sha256,
            "held_out_every": HELD_OUT_EVERY,
            "train_files": len(self.train),
            "held_out_files": len(self.held_out),
            "train_bytes": sum(len(f.text.encode()) for f in self.train),
            "held_out_bytes": sum(len(f.text.encode()) for f in self.held_out),
        }


def name_hash(name: str) -> int:
    return int(hashlib.sha256(name.encode()).hexdigest()[:12], 16)


def is_held_out(name: str) -> bool:
    return name_hash(name) % HELD_OUT_EVERY == 0


def stdlib_files(root: Path | None = None) -> list[TextFile]:
    """Every readable .py file of the standard library (not site-packages), by name."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if "site-packages" in rel.parts or "__pycache__" in rel.parts:
            continue
        try:
            files.append(TextFile(f"stdlib/{rel.as_posix()}", path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue  # a few test fixtures are deliberately not UTF-8
    return files


def project_files() -> list[TextFile]:
    from engine.synth.tokenizer import corpus_text

    return [TextFile("engine/synth/corpus.txt", corpus_text())]


def load_corpus(max_bytes: int = DEFAULT_MAX_BYTES, stdlib_root: Path | None = None) -> Corpus:
    """The project's corpus, then standard-library files in name-hash order, up to `max_bytes` of text,
    split by `is_held_out`."""
    chosen, size = [], 0
    for f in project_files() + sorted(stdlib_files(stdlib_root), key=lambda f: name_hash(f.name)):
        n = len(f.text.encode())
        if size + n > max_bytes and chosen:
            continue
        chosen.append(f)
        size += n
    train = tuple(f for f in chosen if not is_held_out(f.name))
    held = tuple(f for f in chosen if is_held_out(f.name))
    if not train or not held:
        raise ValueError(f"{len(chosen)} files are too few to split into train and held-out parts")
    return Corpus(train, held, platform.python_version())
