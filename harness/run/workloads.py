"""Frozen token-ID workloads: the exact prompts every arm receives, built from a seed and the tokenizer.

A workload is plain JSON: for each phase and attempt, the prompts as token
ids. Prompt text comes from the corpus in the repo (engine/synth/corpus.txt),
starting at an offset drawn from the seed; every prompt opens with a nonce
("3f9a0c...: ") unique to its phase, attempt and index, so no prompt can hit a
cache filled by another phase or by a failed first attempt (beyond, at most,
a shared first token of the hex). The same
seed, settings and tokenizer give the same ids on any machine; the workload's
sha256 (over its canonical JSON) is recorded with every run.

A server the harness did not start keeps its prompt cache from one run to the
next, so its prompts open with nonces drawn from the run's nonce as well
(`with_run_nonce`): nothing it is sent was sent by an earlier run.

Standard workloads for the registry models are committed under
goldens/workloads/; `load_or_build` uses them when the settings match.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

from engine.synth.tokenizer import corpus_text
from engine.tokenizer import Tokenizer
from harness.run import cells
from harness.run.arrivals import rate_name

SCHEMA = 1
ATTEMPTS = 2  # a failed phase is retried once, with fresh nonces
GOLDEN_DIR = Path(__file__).resolve().parents[2] / "goldens" / "workloads"

Encode = Callable[[str], list[int]]


@dataclass(frozen=True)
class WorkloadSettings:
    """What shapes the prompts (output lengths are the run's business, not the workload's); and a field for each
    workload option a kind of cell declares (`cells.with_options`), such as the staggered cell's."""

    seed: int = 0
    decode_prompt_tokens: int = 128
    cold_prompt_tokens: int = 1024
    concurrency: tuple[int, ...] = (4, 8)
    concurrent_prompt_tokens: int = 128
    context_tokens: int | None = None  # long-context phase; None: no such phase
    rates: tuple[float, ...] = ()  # open-loop cells, requests/s (`arrivals`), each `rate_requests` prompts
    rate_requests: int = 32
    prefix_groups: int = 0  # agentic shared-prefix cell: groups x `prefix_group_size` requests, 0: none
    prefix_group_size: int = 4
    prefix_tokens: int = 512  # each group's shared system prompt; each request adds a suffix of its own
    chats: int = 0  # multi-turn cell: chats of `turns` turns through the chat endpoint, 0: none
    turns: int = 4
    turn_chars: int = 400  # each user message's characters; each canned assistant reply half as many
    chat_requests: int = 0  # single-turn chats through the chat endpoint, one at a time, 0: none

    def covers(self, other: WorkloadSettings) -> bool:
        """Whether a workload built with these settings has every prompt `other` asks for."""
        same = (self.seed, self.decode_prompt_tokens, self.cold_prompt_tokens, self.concurrent_prompt_tokens)
        return (
            same == (other.seed, other.decode_prompt_tokens, other.cold_prompt_tokens, other.concurrent_prompt_tokens)
            and set(other.concurrency) <= set(self.concurrency)
            and other.context_tokens in (None, self.context_tokens)
            and set(other.rates) <= set(self.rates)
            and (not other.rates or other.rate_requests == self.rate_requests)
            and (
                not other.prefix_groups
                or (other.prefix_groups, other.prefix_group_size, other.prefix_tokens)
                == (self.prefix_groups, self.prefix_group_size, self.prefix_tokens)
            )
            and (
                not other.chats
                or (other.chats, other.turns, other.turn_chars) == (self.chats, self.turns, self.turn_chars)
            )
            and (
                not other.chat_requests
                or (other.chat_requests, other.turn_chars) == (self.chat_requests, self.turn_chars)
            )
            and all(  # a cell a kind's record builds: its options as they were
                not kind.phases(other)
                or all(
                    getattr(other, o.dest) == getattr(self, o.dest) for o in kind.options if o.scope == cells.WORKLOAD
                )
                for kind in cells.KINDS
                if kind.phases
            )
        )


WorkloadSettings = cells.with_options(WorkloadSettings, cells.WORKLOAD)


@dataclass(frozen=True)
class Workload:
    model: str
    settings: WorkloadSettings
    tokenizer_sha256: str
    # phase -> attempt -> prompts (token ids; the multi-turn cell's: {"messages": [...]} for the chat endpoint)
    phases: dict[str, list[list]]
    run_nonce: str = ""  # `with_run_nonce`: the run's nonce opens every prompt but the probe's

    def prompts(self, phase: str, attempt: int) -> list[list[int]]:
        return self.phases[phase][attempt]

    def to_json(self) -> dict:
        body = {
            "schema": SCHEMA,
            "model": self.model,
            "settings": asdict(self.settings),
            "tokenizer_sha256": self.tokenizer_sha256,
            "phases": self.phases,
        }
        if self.run_nonce:  # (absent otherwise: the frozen workloads keep their hashes)
            body["run_nonce"] = self.run_nonce
        return {**body, "sha256": _sha(body)}

    @property
    def sha256(self) -> str:
        return self.to_json()["sha256"]

    @classmethod
    def from_json(cls, obj: dict) -> Workload:
        body = {k: v for k, v in obj.items() if k != "sha256"}
        if obj.get("schema") != SCHEMA:
            raise ValueError(f"workload schema {obj.get('schema')} is not {SCHEMA}")
        if _sha(body) != obj["sha256"]:
            raise ValueError("workload sha256 does not match its content (edited by hand?)")
        s = dict(obj["settings"])
        s["concurrency"] = tuple(s["concurrency"])
        s["rates"] = tuple(s.get("rates", ()))
        return cls(
            obj["model"], WorkloadSettings(**s), obj["tokenizer_sha256"], obj["phases"], obj.get("run_nonce", "")
        )


def _sha(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def phase_names(settings: WorkloadSettings) -> list[str]:
    """The phases a run with these settings measures, in order."""
    names = ["warmup", "probe", "decode"] + [CHAT] * bool(settings.chat_requests) + ["cold", "warm"]
    names += [f"concurrency-{c}" for c in settings.concurrency]
    if settings.prefix_groups:
        names.append(PREFIX)
    if settings.chats:
        names.append(MULTITURN)
    names += [rate_name(r) for r in settings.rates]
    names += [phase for kind in cells.KINDS if kind.phases for phase in kind.phases(settings)]
    if settings.context_tokens:
        names.append("long")
    return names


# The phases of the cells whose prompts are built here by name (their kinds: `cells`).
PREFIX = cells.PREFIX.name  # the shared-prefix groups' cell
MULTITURN = cells.MULTITURN.name  # the multi-turn chats' cell
CHAT = cells.CHAT.name  # single-turn chats through the chat endpoint (the server's template makes the prompt)


class _Text:
    """Corpus token ids, cycled, read from a seeded offset."""

    def __init__(self, encode: Encode, seed: int):
        self.ids = encode(corpus_text())
        self.pos = int(np.random.Generator(np.random.PCG64([seed, 0x5EED])).integers(0, len(self.ids)))

    def take(self, n: int) -> list[int]:
        out = []
        while len(out) < n:
            chunk = self.ids[self.pos : self.pos + n - len(out)]
            out += chunk
            self.pos = (self.pos + len(chunk)) % len(self.ids)
        return out


def text_prompt(encode: Encode, seed: int, length: int) -> list[int]:
    """`length` corpus token ids read from an offset chosen by `seed` (natural text, frozen)."""
    return _Text(encode, seed).take(length)


def _tag(settings: WorkloadSettings, phase: str, attempt: int, index: int, run_nonce: str) -> str:
    """The nonce that opens a prompt: hex unique to the seed, phase, attempt and index (and the run's nonce)."""
    key = f"{settings.seed}/{phase}/{attempt}/{index}"
    return hashlib.sha256(f"{run_nonce}/{key}".encode() if run_nonce else key.encode()).hexdigest()[:12]


def build(
    model: str, encode: Encode, tokenizer_sha256: str, settings: WorkloadSettings, run_nonce: str = ""
) -> Workload:
    """The workload; `run_nonce` (for `with_run_nonce`) draws every prompt's nonce from it as well."""
    text = _Text(encode, settings.seed)

    def prompt(phase: str, attempt: int, index: int, length: int) -> list[int]:
        # first, so that prompts part at their first token or two
        nonce = encode(f"{_tag(settings, phase, attempt, index, run_nonce)}: ")
        return nonce + text.take(max(length - len(nonce), 1))

    sizes = {
        # One request alone, then one per stream of the largest concurrency at once: kernels that
        # compile per shape (MLX's CUDA backend) are built before anything is timed, for every arm.
        "warmup": [16] * (1 + max(settings.concurrency, default=0)),
        "probe": [settings.decode_prompt_tokens],
        "decode": [settings.decode_prompt_tokens],  # one prompt, sent decode_samples times
        "cold": [settings.cold_prompt_tokens],
        **{f"concurrency-{c}": [settings.concurrent_prompt_tokens] * c for c in settings.concurrency},
    }
    if settings.context_tokens:
        sizes["long"] = [settings.context_tokens]
    # (drawn after the phases above, so that adding these leaves those prompts as they were)
    sizes |= {rate_name(r): [settings.concurrent_prompt_tokens] * settings.rate_requests for r in settings.rates}
    phases = {
        phase: [[prompt(phase, a, i, n) for i, n in enumerate(lengths)] for a in range(ATTEMPTS)]
        for phase, lengths in sizes.items()
    }
    phases["warm"] = phases["cold"]  # the cold prompt again: served from the cache when there is one
    if settings.prefix_groups:
        phases[PREFIX] = [
            [p for g in range(settings.prefix_groups) for p in _group(prompt, text, settings, a, g)]
            for a in range(ATTEMPTS)
        ]
    if settings.chats:
        phases[MULTITURN] = [_chats(settings, a, run_nonce) for a in range(ATTEMPTS)]
    for kind in (k for k in cells.KINDS if k.prompts):  # the cells their records build, after the phases above
        for phase in kind.phases(settings):
            phases[phase] = [kind.prompts(prompt, settings, a) for a in range(ATTEMPTS)]
    if settings.chat_requests:
        phases[CHAT] = [_single_chats(settings, a, run_nonce) for a in range(ATTEMPTS)]
    return Workload(model, settings, tokenizer_sha256, phases, run_nonce)


def with_run_nonce(workload: Workload, encode: Encode, run_nonce: str) -> Workload:
    """`workload` for a server the harness did not start: the same prompt lengths and corpus, every prompt opened by a
    nonce drawn from `run_nonce` too (a server that outlives a run keeps its prompt cache), but the probe's, which
    stays the frozen one so that its greedy output compares with the other arms'."""
    fresh = build(workload.model, encode, workload.tokenizer_sha256, workload.settings, run_nonce)
    return replace(fresh, phases={**fresh.phases, "probe": workload.phases["probe"]})


def _corpus_chars(seed: int, attempt: int, stream: int) -> Callable[[int], str]:
    """`text(n)`: the corpus's next n characters (whitespace runs folded) from an offset drawn from the seed, the
    attempt and `stream` (one stream a cell)."""
    corpus = corpus_text()
    pos = [int(np.random.Generator(np.random.PCG64([seed, attempt, stream])).integers(0, len(corpus)))]

    def text(n: int) -> str:
        out = "".join(corpus[(pos[0] + i) % len(corpus)] for i in range(n))
        pos[0] = (pos[0] + n) % len(corpus)
        return " ".join(out.split())

    return text


def _single_chats(settings: WorkloadSettings, attempt: int, run_nonce: str) -> list[dict]:
    """The chat cell's requests: a system message opened by a nonce of its own and one user message each."""
    text = _corpus_chars(settings.seed, attempt, 0xC4A7)
    requests = []
    for i in range(settings.chat_requests):
        tag = _tag(settings, CHAT, attempt, i, run_nonce)
        requests.append(
            {
                "messages": [
                    {"role": "system", "content": f"{tag}: You answer questions about the text."},
                    {"role": "user", "content": text(settings.turn_chars)},
                ]
            }
        )
    return requests


def _chats(settings: WorkloadSettings, attempt: int, run_nonce: str) -> list[dict]:
    """The multi-turn cell's requests, chat after chat: turn t's messages are the chat's system message,
    its first t user messages and, between them, canned assistant replies (the same for every arm, so that every
    arm is sent the same conversation whatever it replied before); text from the corpus at a seeded offset."""
    text = _corpus_chars(settings.seed, attempt, 0x7A1C)
    requests = []
    for s in range(settings.chats):
        tag = _tag(settings, MULTITURN, attempt, s, run_nonce)
        history = [{"role": "system", "content": f"{tag}: {text(settings.turn_chars)}"}]
        for _ in range(settings.turns):
            history.append({"role": "user", "content": text(settings.turn_chars)})
            requests.append({"messages": list(history)})
            history.append({"role": "assistant", "content": text(settings.turn_chars // 2)})
    return requests


def _group(prompt, text: _Text, settings: WorkloadSettings, attempt: int, group: int) -> list[list[int]]:
    """One shared-prefix group: a system prompt of its own (opened by the group's nonce), then for each request a
    nonce and a suffix of its own (the decode prompts' length)."""
    shared = prompt(PREFIX, attempt, 1000 * (group + 1), settings.prefix_tokens)
    return [
        shared + prompt(PREFIX, attempt, 1000 * (group + 1) + i + 1, settings.decode_prompt_tokens // 2)
        for i in range(settings.prefix_group_size)
    ]


def tokenizer_for(model_dir: Path) -> tuple[Encode, str]:
    """The artifact's tokenizer (as the engine loads it) and the sha256 of its tokenizer.json."""
    tok = Tokenizer(model_dir)
    sha = hashlib.sha256((model_dir / "tokenizer.json").read_bytes()).hexdigest()
    return (lambda s: tok.encode(s, add_special_tokens=False)), sha


def golden_path(model: str, settings: WorkloadSettings) -> Path:
    return GOLDEN_DIR / f"{model}-seed{settings.seed}.json"


STANDARD = WorkloadSettings(context_tokens=4096)  # what the committed workloads are built with


def load_or_build(model: str, model_dir: Path, settings: WorkloadSettings) -> tuple[Workload, Path | None]:
    """The committed workload when its settings and tokenizer match, else a fresh build (and no path)."""
    encode, sha = tokenizer_for(model_dir)
    path = golden_path(model, settings)
    if path.exists():
        stored = Workload.from_json(json.loads(path.read_text()))
        if stored.settings.covers(settings) and stored.tokenizer_sha256 == sha:
            return stored, path
    return build(model, encode, sha, settings), None


def save(workload: Workload, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(workload.to_json(), separators=(",", ":")) + "\n")
