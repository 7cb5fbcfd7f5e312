"""The batch runner: the only place in the batching path that builds arrays.

It holds the running batch (per-layer batched caches, the register of next
input tokens, one sampler and processor set per row) and the joiner group
(a batch of prompts being prefilled together). Each operation mirrors the
matching step of mlx-lm's PromptProcessingBatch / GenerationBatch, which is
what makes the same-B oracle comparison bit-exact:

- joiners start as rows merged from empty caches and appended to the group;
  each iteration prefills one chunk per joiner in one right-padded forward,
  after which the padding is rolled to the left;
- joiners whose prompt is through are split off the group and take token 0
  from an L=1 forward of their last prompt tokens;
- a join extends each running cache by the joiners' (left-padding the
  shorter side); a filter keeps rows and trims shared padding;
- a decode step forwards the whole register, launches sampling of the next
  register, and only then reads the current one back (pipelined);
- with chunk buckets, a prefill forward is right-padded to the smallest
  bucket that holds its longest chunk, not to that chunk: a few lengths, not
  every prompt's; with group buckets, its joiners are filled to the smallest
  group bucket with ghost joiners (empty rows fed the last joiner's chunk,
  dropped after the forward): a few group sizes, not every burst's;
- with decode buckets, the running batch (and the L=1 forward that gives
  joiners their token 0) is filled to the smallest bucket
  that holds its rows with ghost rows (copies of its last row, fed its token,
  their outputs dropped), so a decode step takes one of a few shapes and the
  kernels compiled per shape are compiled once; the ghosts are rebuilt at
  every join and filter, so the real rows' shared padding is what it would
  be without them.

A row whose own sampling fails (setting up its sampler or processors,
running them, emitting its token) leaves alone: the runner drops it and
reports a RowFailure; the other rows go on with the tokens they would have
had.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from engine.batch.spec_rows import SpecRows
from engine.cache import (
    BatchCache,
    BatchKVCache,
    BatchQuantizedKVCache,
    BatchRotatingKVCache,
    Cache,
    KVCache,
    QuantizedKVCache,
    RecurrentCache,
    RotatingKVCache,
    cache_arrays,
    cache_nbytes,
    own,
)
from engine.cache.kv import owned_copies
from engine.generate import KVQuantization
from engine.grammar import mask_rows
from engine.kernels.cuda_source import BUILDS
from engine.prompt_logprobs import PromptScorer
from engine.request import GeneratedToken, SamplingParams
from engine.sampling import Sampler, emitted_token, make_processors

# (request_id, logits [1, V]) for every row at every forward: the parity tap.
LogitsTap = Callable[[str, mx.array], None]

BATCHABLE_CACHES = (KVCache, RotatingKVCache, RecurrentCache)


def can_batch(model: nn.Module) -> bool:
    """Whether every layer's cache has a batched form (mlx-lm's all-caches-merge check)."""
    return all(type(c) in BATCHABLE_CACHES for c in model.make_cache())


MIXED_KV = "with quantized KV a prefill group is fresh (full precision) or quantized, not both (`kv_groups`)"


def _batch_cache(layer: list[Cache]) -> BatchCache:
    """One layer's batch cache from its single-row caches, empty or holding a cached prefix (mlx-lm's merge);
    quantized ones (cached prefixes with quantized KV) all alike."""
    if len({type(c) for c in layer}) > 1:
        raise ValueError(MIXED_KV)
    if isinstance(layer[0], RotatingKVCache):
        return BatchRotatingKVCache.merge(layer)
    if isinstance(layer[0], RecurrentCache):
        return RecurrentCache.merge(layer)
    if isinstance(layer[0], QuantizedKVCache):
        return BatchQuantizedKVCache.merge(layer, group_size=layer[0].group_size, bits=layer[0].bits)
    return BatchKVCache.merge(layer)


def merge_rows(singles: Sequence[list[Cache]]) -> list[BatchCache]:
    """One batch's caches (a list per layer) from each row's single-row caches, as rows join a batch."""
    return [_batch_cache([s[layer] for s in singles]) for layer in range(len(singles[0]))]


@dataclass(frozen=True)
class RowFailure:
    """A row that failed on its own; the runner has already dropped it."""

    request_id: str
    error: str


@dataclass(frozen=True)
class RowTokens:
    """One token per row that goes on (by request id, in row order), the rows that failed alone and left, and
    (token 0 only) the single-row caches of the prompt bodies asked for."""

    tokens: dict[str, GeneratedToken]
    failures: tuple[RowFailure, ...] = ()
    prompts: dict[str, list] = field(default_factory=dict)
    scores: dict[str, tuple[GeneratedToken, ...]] = field(default_factory=dict)  # token 0: scored prompts


@dataclass(frozen=True)
class Joiner:
    request_id: str
    params: SamplingParams
    prompt_ids: Sequence[int]
    cache: list | None = None  # single-row caches holding a cached prefix of the prompt
    prompt_logprobs: int | None = None  # score the prompt (`GenerationRequest.prompt_logprobs`); never cached
    spec: bool = False  # joins the spec rows: with an MTP head, its prompt's hidden states are kept for the head


@dataclass
class _Row:
    request_id: str
    params: SamplingParams
    sampler: Sampler
    processors: list
    history: mx.array | None  # tokens seen, for processors (prompt, then fed tokens)
    last_prompt_token: int  # what the token-0 forward feeds
    grammar: Any | None = None  # the request's grammar matcher (engine.grammar), masked with the batch's others
    scorer: PromptScorer | None = None  # fed the prefill chunks' logits where the request scores its prompt
    # The target's final hidden states over the prompt positions this row fed, chunk by chunk ([1, n, H] each),
    # for an MTP spec row's head (the prompt's pairs); None: not kept (every other row)
    hidden: list[mx.array] | None = None

    @classmethod
    def start(cls, j: Joiner, keep_hidden: bool = False) -> _Row:
        history = mx.array(list(j.prompt_ids[:-1])) if len(j.prompt_ids) > 1 else None
        grammar = j.params.constraint.processor() if j.params.constraint is not None else None
        scorer = PromptScorer(j.prompt_ids, j.prompt_logprobs) if j.prompt_logprobs is not None else None
        return cls(
            j.request_id,
            j.params,
            Sampler(j.params),
            make_processors(j.params, constraint=False),
            history,
            j.prompt_ids[-1],
            grammar,
            scorer,
            [] if keep_hidden else None,
        )

    def process(self, inputs: mx.array, logits: mx.array) -> mx.array:
        """Apply this row's processors to its logits [1, V], given this step's input token(s)."""
        if not self.processors and self.grammar is None:
            return logits
        self.history = inputs if self.history is None else mx.concatenate([self.history, inputs])
        for p in self.processors:
            logits = p(self.history, logits)
        return logits


def _guarded(failed: dict[int, str], i: int, compute: Callable[[], mx.array], stand_in: Callable[[], mx.array]):
    """compute(), or stand_in() with row i's error recorded in `failed`."""
    try:
        return compute()
    except Exception as e:  # noqa: BLE001 - one row's sampling, nobody else's
        failed.setdefault(i, f"sampling failed: {e!r}")
        return stand_in()


def _failures(rows: list[_Row], failed: dict[int, str]) -> tuple[RowFailure, ...]:
    return tuple(RowFailure(rows[i].request_id, failed[i]) for i in sorted(failed))


@dataclass
class _Sampled:
    tokens: mx.array  # [B]
    logprobs: mx.array  # [B, V]

    def take(self, rows: Sequence[int]) -> _Sampled:
        idx = mx.array(list(rows))
        return _Sampled(self.tokens[idx], self.logprobs[idx])

    def then(self, other: _Sampled) -> _Sampled:
        return _Sampled(mx.concatenate([self.tokens, other.tokens]), mx.concatenate([self.logprobs, other.logprobs]))


def bucket(rows: int, buckets: Sequence[int]) -> int:
    """The smallest of `buckets` (ascending) that holds `rows`; `rows` itself past the largest or with none."""
    return next((b for b in buckets if b >= rows), rows)


def _add_ghosts(cache: list[BatchCache], rows: int, ghosts: int) -> None:
    """`ghosts` copies of row `rows - 1`'s caches after the batch's `rows` rows."""
    last = [c.extract(rows - 1) for c in cache]
    for c, extra in zip(cache, merge_rows([last] * ghosts)):
        c.extend(extra)


def _ghost_tokens(tokens: mx.array, ghosts: int) -> mx.array:
    """The rows' tokens, then the last row's for each ghost (a ghost holds that row's caches)."""
    return mx.concatenate([tokens, mx.broadcast_to(tokens[-1:], (ghosts,))])


def trace_forwards(
    model: nn.Module, decode_rows: Sequence[int], prefill_tokens: Sequence[int], prompt: int = 16
) -> None:
    """Build, without running, the continuous lane's forwards: a decode step at each of `decode_rows` (after a
    `prompt`-token prefill of as many rows) and a one-prompt prefill chunk of each of `prefill_tokens`. Every
    kernel build they call is asked for, so the kernel cache compiles them all at once; nothing is evaluated
    and the caches are dropped."""
    for rows in decode_rows:
        cache = merge_rows([model.make_cache() for _ in range(rows)])
        model(mx.zeros((rows, prompt), mx.int32), cache=cache)
        model(mx.zeros((rows, 1), mx.int32), cache=cache)
    for n in prefill_tokens:
        model(mx.zeros((1, n), mx.int32), cache=merge_rows([model.make_cache()]))


def power_buckets(batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... below `batch`, then `batch`: the decode row counts --decode-buckets auto takes."""
    out, b = [], 1
    while b < batch:
        out.append(b)
        b *= 2
    return (*out, batch)


def chunk_buckets(prefill_chunk: int) -> tuple[int, ...]:
    """Prefill chunk lengths 16, 24, 32, 48, 64, ... (powers of two and halfway between) below
    `prefill_chunk`, then it: a chunk padded to its bucket is at most 1.5x (and 15 tokens) longer."""
    out, b = [], 16
    while b < prefill_chunk:
        out.append(b)
        if b * 3 // 2 < prefill_chunk:
            out.append(b * 3 // 2)
        b *= 2
    return (*out, prefill_chunk)


class BatchRunner:
    def __init__(
        self,
        model: nn.Module,
        tap: LogitsTap | None = None,
        kv: KVQuantization | None = None,
        decode_buckets: Sequence[int] = (),
        chunk_buckets: Sequence[int] = (),
        group_buckets: Sequence[int] = (),
        spec: SpecRows | None = None,
    ):
        if kv is not None and kv.start != 0:
            raise ValueError("the batch lane quantizes KV from the first token (start 0) only")
        if any(b < 1 for b in (*decode_buckets, *chunk_buckets, *group_buckets)):
            raise ValueError(
                f"buckets are counts >= 1, got {list(decode_buckets)}, {list(chunk_buckets)} and {list(group_buckets)}"
            )
        if kv is not None and (decode_buckets or group_buckets):
            raise ValueError(
                "decode and group buckets do not combine with quantized KV (ghost rows copy full-precision caches)"
            )
        self.model = model
        self.tap = tap
        self.kv = kv
        self.buckets = tuple(sorted(set(decode_buckets)))
        self.chunk_buckets = tuple(sorted(set(chunk_buckets)))
        self.group_buckets = tuple(sorted(set(group_buckets)))
        # The forward shapes this runner has run (kind, rows[, tokens, right-padded]): on CUDA each new one compiles
        # kernels.
        self.shapes: set[tuple[int | str, ...]] = set()
        self.rows: list[_Row] = []
        self.cache: list | None = None  # the running rows', then `ghosts` ghost rows'
        self.ghosts = 0
        self.register: _Sampled | None = None  # sampled, not yet fed back
        self.joiners: list[_Row] = []
        self.joiner_cache: list | None = None
        # Joiners split off with their token 0, waiting to join (or to be dropped).
        self.ready: list[_Row] = []
        self.ready_cache: list | None = None
        self.ready_first: _Sampled | None = None
        self.spec = spec  # the spec rows, a group of their own (spec_rows.py); None: no request speculates
        # the spec rows' batched draft is the MTP head, which starts from the prompt's pairs (speculative/mtp.py)
        self._head_sees_hidden = spec is not None and getattr(spec.draft, "sees_hidden", False)

    # --------------------------------------------------------------- joiners

    def add_joiners(self, joiners: Sequence[Joiner]) -> list[RowFailure]:
        """Append new prompts to the prefill group (rows merged from empty or prefix caches).

        A joiner whose sampler or processors cannot be set up (a seed out of
        range, ...) is left out and comes back as a failure. With quantized KV,
        joiners with cached prefixes (quantized) join a group that has run a
        chunk, or only such joiners: the scheduler's `kv_groups`.
        """
        rows, kept, failures = [], [], []
        for j in joiners:
            try:
                rows.append(_Row.start(j, keep_hidden=j.spec and self._head_sees_hidden))
                kept.append(j)
            except Exception as e:  # noqa: BLE001 - this joiner's settings, nobody else's
                failures.append(RowFailure(j.request_id, f"sampling setup failed: {e!r}"))
        if not kept:
            return failures
        fresh = self.model.make_cache()
        merged = merge_rows([j.cache if j.cache is not None else fresh for j in kept])
        if self.joiner_cache is not None and any(type(a) is not type(b) for a, b in zip(self.joiner_cache, merged)):
            raise ValueError(MIXED_KV)
        if self.joiner_cache is None:
            self.joiner_cache = merged
        else:
            for group, new in zip(self.joiner_cache, merged):
                group.extend(new)
        self.joiners += rows
        return failures

    def prefill(self, chunks: Sequence[Sequence[int]], clear_cache: bool = True) -> None:
        """One chunk per joiner (group order) through the model, right-padded to the longest (to its chunk
        bucket), the group filled with ghost joiners to its group bucket; a joiner that scores its prompt is fed
        its rows of the forward's logits. `clear_cache`: empty MLX's buffer cache after it (not between decode
        steps: each would allocate its buffers again)."""
        joiners = len(chunks)
        ghosts = bucket(joiners, self.group_buckets) - joiners
        if ghosts > 0:  # empty rows fed the last joiner's chunk: no joiner's caches move (they are the longer side)
            fresh = self.model.make_cache()
            for group, extra in zip(self.joiner_cache, merge_rows([fresh] * ghosts)):
                group.extend(extra)
            chunks = [*chunks, *[chunks[-1]] * ghosts]
        lengths = [len(c) for c in chunks]
        longest = bucket(max(lengths), self.chunk_buckets)
        padding = [longest - n for n in lengths]
        self.shapes.add(("prefill", len(chunks), longest, max(padding) > 0))  # right padding: masks, a roll after
        if max(padding) > 0:
            for c in self.joiner_cache:
                c.prepare(lengths=lengths, right_padding=padding)
        hidden = self.model.hidden(mx.array([list(c) + [0] * p for c, p in zip(chunks, padding)]), self.joiner_cache)
        BUILDS.settle()
        kept = []
        for i, row in enumerate(self.joiners[:joiners]):
            if row.scorer is not None:
                row.scorer.add(self.model.logits(hidden[i, : lengths[i]]))
            if row.hidden is not None:  # an MTP spec row: its own copy, not a view holding the padded chunk's
                kept += owned_copies([hidden[i : i + 1, : lengths[i]]])
                row.hidden.append(kept[-1])
        mx.eval(cache_arrays(self.joiner_cache), kept)
        if max(padding) > 0:
            for c in self.joiner_cache:
                c.finalize()
            mx.eval(cache_arrays(self.joiner_cache))
        if ghosts > 0:  # the joiners' caches as they would be without the ghosts, padding included
            for c in self.joiner_cache:
                c.filter(list(range(joiners)), trim=False)
            mx.eval(cache_arrays(self.joiner_cache))
        self._quantize_kv(self.joiner_cache)
        if clear_cache:
            mx.clear_cache()

    def first_tokens(
        self, request_ids: Sequence[str], snapshot: Collection[str] = (), room: int | None = None
    ) -> RowTokens:
        """Split these joiners off the group; token 0 of each from an L=1 forward of its last prompt token
        (read now). The split joiners in `snapshot` hand back a copy of their caches before that forward
        (`RowTokens.prompts`), in order while the copies fit in `room` bytes (None: all). A split joiner whose
        token 0 cannot be sampled leaves the split."""
        position = {row.request_id: i for i, row in enumerate(self.joiners)}
        indices = [position[r] for r in request_ids]
        taken = set(indices)
        rest = [i for i in range(len(self.joiners)) if i not in taken]
        self.ready = [self.joiners[i] for i in indices]
        self.ready_cache = [copy.copy(c) for c in self.joiner_cache]
        for c in self.ready_cache:
            c.filter(indices)
        if rest:
            for c in self.joiner_cache:
                c.filter(rest)
            self.joiners = [self.joiners[i] for i in rest]
        else:
            self.joiners, self.joiner_cache = [], None
        prompts = {}
        for i, row in enumerate(self.ready):
            if row.request_id in snapshot:
                layers = [c.extract(i) for c in self.ready_cache]  # copies, not yet made: free to drop
                nbytes = cache_nbytes(layers)
                if room is None or nbytes <= room:
                    prompts[row.request_id] = layers
                    room = None if room is None else room - nbytes
        own(prompts.values())
        inputs = mx.array([row.last_prompt_token for row in self.ready])
        logits = self._first_forward(inputs, keep_hidden=[row.hidden is not None for row in self.ready])
        self._quantize_kv(self.ready_cache)
        sampled, failed = self._sample(self.ready, inputs, logits)
        BUILDS.settle()
        mx.eval(sampled.tokens, sampled.logprobs, [row.hidden for row in self.ready if row.hidden])
        self.ready_first = sampled
        tokens = self._emitted(self.ready, sampled, failed)
        scores = {row.request_id: row.scorer.result() for row in self.ready if row.scorer is not None}
        if not failed:
            return RowTokens(tokens, prompts=prompts, scores=scores)
        failures = _failures(self.ready, failed)
        keep = [i for i in range(len(self.ready)) if i not in failed]
        for f in failures:
            prompts.pop(f.request_id, None)
        self.ready = [self.ready[i] for i in keep]
        if keep:
            for c in self.ready_cache:
                c.filter(keep)
            self.ready_first = sampled.take(keep)
        else:
            self.ready_cache = self.ready_first = None
        return RowTokens(tokens, failures, prompts, scores)

    def _first_forward(self, inputs: mx.array, keep_hidden: Sequence[bool] = ()) -> mx.array:
        """The split's L=1 forward, its rows filled with ghosts to their decode bucket (a shape the decode
        steps compile anyway; the ghosts leave the split's caches after): logits of the split's rows. Rows that
        keep their hidden states (MTP spec rows) get the last prompt position's; otherwise the full forward
        runs as ever."""
        n = inputs.shape[0]
        ghosts = bucket(n, self.buckets) - n
        if ghosts > 0:
            _add_ghosts(self.ready_cache, n, ghosts)
            inputs = _ghost_tokens(inputs, ghosts)
        self.shapes.add(("first", n + ghosts))
        if any(keep_hidden):
            hidden = self.model.hidden(inputs[:, None], self.ready_cache)
            logits = self.model.logits(hidden)[:, -1, :]
            for i, keep in enumerate(keep_hidden):
                if keep:
                    self.ready[i].hidden += owned_copies([hidden[i : i + 1]])
        else:
            logits = self.model(inputs[:, None], cache=self.ready_cache)[:, -1, :]
        if ghosts > 0:
            for c in self.ready_cache:
                c.filter(list(range(n)))
            logits = logits[:n]
        return logits

    def join(self, request_ids: Collection[str], spec: Mapping[str, tuple[Sequence[int], int]] | None = None) -> None:
        """These split joiners become the last rows of the batch (in split order); the rest of the split goes.
        Those in `spec` (request id -> prompt and max_tokens) join the spec rows instead."""
        if spec:
            taken = [i for i, row in enumerate(self.ready) if row.request_id in request_ids and row.request_id in spec]
            if taken:
                cache = [copy.copy(c) for c in self.ready_cache]
                for c in cache:
                    c.filter(taken)
                rows = [self.ready[i] for i in taken]
                self.spec.join(
                    [r.request_id for r in rows],
                    [r.params for r in rows],
                    [spec[r.request_id][0] for r in rows],
                    [spec[r.request_id][1] for r in rows],
                    cache,
                    self.ready_first.take(taken).tokens.tolist(),
                    # the MTP head's prompt pairs: hidden states over the positions the rows fed (after a
                    # prompt-cache hit, the uncached suffix only: the cached part's were never computed here)
                    [mx.concatenate(r.hidden, axis=1) if r.hidden else None for r in rows],
                )
                request_ids = {rid for rid in request_ids if rid not in spec}
        keep = [i for i, row in enumerate(self.ready) if row.request_id in request_ids]
        if keep:
            if len(keep) < len(self.ready):
                for c in self.ready_cache:
                    c.filter(keep)
                self.ready_first = self.ready_first.take(keep)
            if self.cache is None:
                self.cache, self.register = self.ready_cache, self.ready_first
            else:
                self._drop_ghosts()
                for running, joiner in zip(self.cache, self.ready_cache):
                    running.extend(joiner)
                self.register = self.register.then(self.ready_first)
            self.rows += [self.ready[i] for i in keep]
            self._fill_to_bucket()
        self.ready, self.ready_cache, self.ready_first = [], None, None

    def joiner_extract(self, request_id: str, layers: Collection[int]) -> list:
        """A prefilling joiner's caches so far in these layers, as single-row caches (copies, not yet made:
        `own` them to keep them); None elsewhere."""
        index = next(i for i, row in enumerate(self.joiners) if row.request_id == request_id)
        return [c.extract(index) if i in layers else None for i, c in enumerate(self.joiner_cache)]

    def ready_extract(self, request_id: str) -> list:
        """A split joiner's caches (prompt only), as single-row caches."""
        index = next(i for i, row in enumerate(self.ready) if row.request_id == request_id)
        caches = [c.extract(index) for c in self.ready_cache]
        own([caches])
        return caches

    def leave_group(self, request_ids: Collection[str]) -> None:
        """These joiners leave the prefill group."""
        keep = [i for i, row in enumerate(self.joiners) if row.request_id not in request_ids]
        if not keep:
            self.drop_joiners()
            return
        for c in self.joiner_cache:
            c.filter(keep)
        self.joiners = [self.joiners[i] for i in keep]

    def drop_joiners(self) -> None:
        """The whole prefill group and any split joiners go (their prefill failed)."""
        self.joiners, self.joiner_cache = [], None
        self.ready, self.ready_cache, self.ready_first = [], None, None

    # ---------------------------------------------------------------- decode

    def decode(self) -> RowTokens:
        """Feed the register to the model, launch the next register, return the fed tokens.

        A row whose next token cannot be sampled, or whose fed token cannot be
        emitted, leaves the batch now.
        """
        inputs = self.register
        fed = inputs.tokens
        if self.ghosts:
            fed = _ghost_tokens(fed, self.ghosts)
        self.shapes.add(("decode", fed.shape[0]))
        logits = self.model(fed[:, None], cache=self.cache)[:, -1, :]
        if self.ghosts:
            logits = logits[: len(self.rows)]
        following, failed = self._sample(self.rows, inputs.tokens, logits)
        BUILDS.settle()
        mx.async_eval(following.tokens, following.logprobs)
        self.register = following
        tokens = self._emitted(self.rows, inputs, failed)  # waits for the previous step only
        if not failed:
            return RowTokens(tokens)
        failures = _failures(self.rows, failed)
        self._filter([i for i in range(len(self.rows)) if i not in failed])
        return RowTokens(tokens, failures)

    def leave(self, request_ids: Collection[str]) -> None:
        """These rows leave the batch (plain or spec rows)."""
        if self.spec is not None:
            self.spec.leave(request_ids)
        keep = [i for i, row in enumerate(self.rows) if row.request_id not in request_ids]
        if self.spec is None or len(keep) < len(self.rows):
            self._filter(keep)

    def _filter(self, keep: Sequence[int]) -> None:
        keep = list(keep)
        if not keep:
            self.reset()
            return
        for c in self.cache:
            c.filter(keep)  # the ghosts, past the rows, go too
        self.ghosts = 0
        self.register = self.register.take(keep)
        self.rows = [self.rows[i] for i in keep]
        self._fill_to_bucket()

    def extract(self, request_ids: Collection[str]) -> dict[str, list]:
        """These rows, each as single-row caches (copies; the batch goes on changing), evaluated in one call."""
        index = {r.request_id: i for i, r in enumerate(self.rows)}
        out = {rid: [c.extract(index[rid]) for c in self.cache] for rid in request_ids if rid in index}
        own(out.values())
        if self.spec is not None and len(out) < len(request_ids):
            out.update(self.spec.extract([rid for rid in request_ids if rid not in index]))
        return out

    def reset(self) -> None:
        """Drop the running batch (after the last row leaves, or a failed forward)."""
        self.rows, self.cache, self.register, self.ghosts = [], None, None, 0

    def _drop_ghosts(self) -> None:
        if self.ghosts:
            for c in self.cache:
                c.filter(list(range(len(self.rows))))
            self.ghosts = 0

    def _fill_to_bucket(self) -> None:
        """Ghost rows after the running rows, up to their bucket: copies of the last row's caches."""
        want = bucket(len(self.rows), self.buckets) - len(self.rows)
        if want <= 0 or self.cache is None:
            return
        _add_ghosts(self.cache, len(self.rows), want)
        self.ghosts = want

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    # --------------------------------------------------------------- helpers

    def _quantize_kv(self, cache: list) -> None:
        """After a forward, as the serial scheme does: full-precision KV layers become quantized."""
        if self.kv is None:
            return
        for i, c in enumerate(cache):
            if type(c) is BatchKVCache:
                cache[i] = BatchQuantizedKVCache.from_full(c, self.kv.group_size, self.kv.bits)

    def _sample(self, rows: list[_Row], inputs: mx.array, logits: mx.array) -> tuple[_Sampled, dict[int, str]]:
        """The next token of every row, and the rows (index -> error) whose processors or sampler raised.

        A failed row gets a stand-in (its raw logits, their argmax) so the
        batch keeps its shape; every row's math is its own, so the others'
        tokens are unchanged.
        """
        failed: dict[int, str] = {}
        if self.tap is not None:
            for i, row in enumerate(rows):
                self.tap(row.request_id, logits[i : i + 1])
        if any(r.processors or r.grammar is not None for r in rows):
            row_logits = [logits[i : i + 1] for i in range(len(rows))]
            logits = mx.concatenate(
                [
                    _guarded(failed, i, lambda: row.process(inputs[i : i + 1], row_logits[i]), lambda: row_logits[i])
                    for i, row in enumerate(rows)
                ],
                axis=0,
            )
        constrained = [
            (i, r.grammar, r.history) for i, r in enumerate(rows) if r.grammar is not None and i not in failed
        ]
        if constrained:
            logits = mask_rows(logits, constrained)
            for i, m, _ in constrained:
                if m.error is not None:
                    failed[i] = f"grammar: {m.error}"
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        if all(r.params.is_greedy for r in rows):  # one vectorized argmax over [B, V]
            tokens = mx.argmax(logprobs, axis=-1)
        else:
            row_logprobs = [logprobs[i : i + 1] for i in range(len(rows))]
            tokens = mx.concatenate(
                [
                    _guarded(
                        failed, i, lambda: row.sampler(row_logprobs[i]), lambda: mx.argmax(row_logprobs[i], axis=-1)
                    )
                    for i, row in enumerate(rows)
                ],
                axis=0,
            )
        return _Sampled(tokens, logprobs), failed

    @staticmethod
    def _emitted(rows: list[_Row], sampled: _Sampled, failed: dict[int, str]) -> dict[str, GeneratedToken]:
        """The emitted tokens of the rows not in `failed`, by request id; a row whose token cannot be emitted
        joins `failed`."""
        ids = sampled.tokens.tolist()
        out = {}
        for i, row in enumerate(rows):
            if i in failed:
                continue
            try:
                out[row.request_id] = emitted_token(ids[i], sampled.logprobs[i], row.params)
            except Exception as e:  # noqa: BLE001 - this row's logprobs request, nobody else's
                failed[i] = f"emitting a token failed: {e!r}"
        return out
