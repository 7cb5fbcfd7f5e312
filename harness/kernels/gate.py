"""The fast tier's numerics gate: each kernel tier against the float32 reference, position by position.

A tier that is not bit-exact is judged against the true function of the
artifact (`harness.kernels.float_reference`), not against another rounding of it: on
random-weight models the distributions are near-flat, and any change in the
order of a sum flips greedy tokens within a few steps, however valid.

Teacher-forced, so that every tier is compared on the same tokens: for each
prompt the exact tier decodes `steps` tokens greedily (the largest row count's
rows as one batch, which is its forced run at that count); those tokens go to
the reference (one float32 forward over prompt and tokens), to the exact tier
and to the fast tier (the prompt prefilled, then one token a step, `rows` rows
a batch, each row against its own reference). At every position,
per tier: KL(reference || tier), whether its top-1 token is the reference's,
and the largest |logit difference|. The fast tier passes when over all
positions its mean KL is at most `KL_RATIO` times the exact tier's plus
`KL_SLACK`, and its top-1 agreement is at least the exact tier's less
`TOP1_MARGIN`.
"""

from __future__ import annotations

import copy
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from engine.batch.runner import merge_rows
from engine.generate import prefill
from engine.kernels import EXACT, FAST, KernelConfig, install
from engine.loading import load_model, vocab_size
from harness.gates.parity import PROMPT_LENGTHS
from harness.kernels.float_reference import batches, load_reference, reference_files
from oracles.cases import frozen_prompt_ids

GATE_STEPS = 64
KL_RATIO = 1.25  # the fast tier's mean KL to the reference, at most this times the exact tier's ...
KL_SLACK = 1e-6  # ... plus this (nats): where the exact tier is the reference to float32 rounding (float32 models)
TOP1_MARGIN = 0.01  # its top-1 agreement with the reference at least the exact tier's less one percentage point


@dataclass(frozen=True)
class TierScore:
    """One tier against the reference over some positions."""

    mean_kl: float
    max_kl: float
    top1_agreement: float
    max_abs_logit_diff: float
    positions: int

    @classmethod
    def pooled(cls, scores: Sequence[TierScore]) -> TierScore:
        n = sum(s.positions for s in scores)
        return cls(
            sum(s.mean_kl * s.positions for s in scores) / n,
            max(s.max_kl for s in scores),
            sum(s.top1_agreement * s.positions for s in scores) / n,
            max(s.max_abs_logit_diff for s in scores),
            n,
        )


@dataclass(frozen=True)
class PromptGate:
    prompt_len: int
    seed: int
    exact: TierScore
    fast: TierScore


@dataclass(frozen=True)
class GateResult:
    rows: int
    steps: int
    prompts: tuple[PromptGate, ...]
    fast_kernels: dict  # the KernelSet the fast side ran

    @property
    def exact(self) -> TierScore:
        return TierScore.pooled([p.exact for p in self.prompts])

    @property
    def fast(self) -> TierScore:
        return TierScore.pooled([p.fast for p in self.prompts])

    @property
    def kl_passed(self) -> bool:
        return self.fast.mean_kl <= KL_RATIO * self.exact.mean_kl + KL_SLACK

    @property
    def top1_passed(self) -> bool:
        return self.fast.top1_agreement >= self.exact.top1_agreement - TOP1_MARGIN

    @property
    def passed(self) -> bool:
        return self.kl_passed and self.top1_passed

    def as_record(self) -> dict:
        return {
            "passed": self.passed,
            "rows": self.rows,
            "steps": self.steps,
            "criteria": {
                "kl_ratio": KL_RATIO,
                "kl_slack": KL_SLACK,
                "top1_margin": TOP1_MARGIN,
                "kl_passed": self.kl_passed,
                "top1_passed": self.top1_passed,
            },
            "exact": asdict(self.exact),
            "fast": asdict(self.fast),
            "prompts": [asdict(p) for p in self.prompts],
            "fast_kernels": self.fast_kernels,
        }


def gate_prompts(
    rows: int, vocab: int, lengths: Sequence[int] = PROMPT_LENGTHS, seed: int = 0
) -> list[tuple[int, int]]:
    """(length, seed) of each prompt: the standard lengths, repeated with the next seed until there are at
    least `rows` and a whole number of batches of `rows`."""
    count = max(len(lengths), rows)
    count += -count % rows
    return [(lengths[i % len(lengths)], seed + i // len(lengths)) for i in range(count)]


def _log_softmax(logits: mx.array) -> mx.array:
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


def score(reference: mx.array, tier: mx.array) -> TierScore:
    """`tier`'s logits [S, V] against the reference's at the same S positions."""
    ref, got = reference.astype(mx.float32), tier.astype(mx.float32)
    lr, lt = _log_softmax(ref), _log_softmax(got)
    p = mx.exp(lr)
    kl = mx.sum(mx.where(p > 0, p * (lr - lt), 0.0), axis=-1)
    top1 = mx.argmax(ref, axis=-1) == mx.argmax(got, axis=-1)
    diff = mx.max(mx.abs(ref - got), axis=-1)
    mx.eval(kl, top1, diff)
    return TierScore(
        kl.mean().item(), kl.max().item(), top1.astype(mx.float32).mean().item(), diff.max().item(), kl.size
    )


@dataclass
class Prefilled:
    """A prompt prefilled alone: its caches and last id. `greedy` and `forced` decode on the caches they are
    given; a prompt used again hands each use a `copy`."""

    cache: list
    last: int

    @classmethod
    def of(cls, model: nn.Module, ids: Sequence[int]) -> Prefilled:
        cache = model.make_cache()
        last = prefill(model, cache, mx.array(list(ids))).item()
        return cls(cache, last)

    def copy(self) -> Prefilled:
        return Prefilled(copy.deepcopy(self.cache), self.last)


def decode(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    steps: int,
    tokens: Sequence[Sequence[int]] | None = None,
    starts: Sequence[Prefilled | None] = (),
) -> tuple[list[list[int]], list[mx.array]]:
    """Each prompt's row decoded `steps` tokens, all rows as one batch: fed `tokens` where given (forced), else
    each row's own greedy choice. Each prompt is prefilled on its own (or taken from `starts`, prefilled so by this
    model and tier; their caches are decoded on), the rows' caches merged (left-padded, as the continuous batcher
    joins rows), then one token a row a step; one prompt decodes on plain caches, as the serial lane does. The
    tokens fed after the prompts' last ids (the last of `steps` is chosen, not fed) and each row's logits
    [steps, V]."""
    starts = [s or Prefilled.of(model, ids) for ids, s in zip(prompts, starts or [None] * len(prompts))]
    singles = [s.cache for s in starts]
    cache = singles[0] if len(prompts) == 1 else merge_rows(singles)
    inputs = mx.array([[s.last] for s in starts])
    chosen, out = [[] for _ in prompts], []
    for i in range(steps):
        logits = model(inputs, cache)[:, -1].astype(mx.float32)
        mx.eval(logits)
        out.append(logits)
        if tokens is None:
            for row, best in zip(chosen, mx.argmax(logits, axis=-1).tolist()):
                row.append(best)
        if i + 1 < steps:
            inputs = mx.array([[row[i]] for row in (chosen if tokens is None else tokens)])
    stacked = mx.stack(out, axis=1)  # [rows, steps, V]
    return (chosen if tokens is None else [list(t) for t in tokens]), [stacked[r] for r in range(len(prompts))]


def greedy(
    model: nn.Module, ids: Sequence[int], steps: int, start: Prefilled | None = None
) -> tuple[list[int], mx.array]:
    """One row decoded greedily (from `start`, the prompt prefilled, where given): its tokens and the logits
    [steps, V] that chose them."""
    (tokens,), (logits,) = decode(model, [ids], steps, starts=[start])
    return tokens, logits


def forced(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    tokens: Sequence[Sequence[int]],
    starts: Sequence[Prefilled | None] = (),
) -> list[mx.array]:
    """The logits [steps, V] of each prompt's row fed `tokens` after it, all rows decoding as one batch
    (`decode`)."""
    return decode(model, prompts, len(tokens[0]), tokens, starts)[1]


def run_gates(
    path: Path,
    rows: Sequence[int] = (1,),
    steps: int = GATE_STEPS,
    fast: KernelConfig = KernelConfig(FAST),
    lengths: Sequence[int] = PROMPT_LENGTHS,
    seed: int = 0,
    on_progress: Callable[[str], None] | None = None,
) -> list[GateResult]:
    """The gate on the artifact at `path` at each row count (`gate_prompts`), the fast side with `fast`. A
    prompt several row counts share is decoded and referenced once; the exact tier's greedy continuations decode
    the widest row count's rows together."""
    say = on_progress or (lambda message: None)
    model, config = load_model(path)
    install(model, KernelConfig(EXACT))
    vocab = vocab_size(config)
    specs = {r: gate_prompts(r, vocab, lengths, seed) for r in rows}
    unique = list(dict.fromkeys(spec for r in rows for spec in specs[r]))
    prompts = {spec: frozen_prompt_ids(spec[0], vocab, spec[1]) for spec in unique}
    # The exact tier's greedy continuations, the widest row count's rows a batch: those batches are that row
    # count's forced runs (the same rows, caches and tokens), and the prompts' prefills serve the others'.
    widest = max(rows)
    tokens, runs, prefilled = {}, {}, {}
    greedy_batches = [unique[b : b + widest] for b in range(0, len(unique), widest)]
    for i, batch in enumerate(greedy_batches):
        say(f"exact tier: greedy continuations, {len(batch)} rows a batch, batch {i + 1}/{len(greedy_batches)}")
        starts = [Prefilled.of(model, prompts[spec]) for spec in batch]
        if len(rows) > 1:
            prefilled.update((spec, start.copy()) for spec, start in zip(batch, starts))
        chosen, logits = decode(model, [prompts[spec] for spec in batch], steps, starts=starts)
        tokens.update(zip(batch, chosen))
        if batch[0] in specs[widest]:
            runs.update(zip(batch, logits))
        del starts, logits
    sequences, starts = [prompts[s] + tokens[s][:-1] for s in unique], [len(prompts[s]) for s in unique]
    say(f"float32 reference ({len(unique)} sequences, {len(batches(sequences, starts))} forwards)")
    # the reference's logits stay in files, each read for a score and freed after it: [steps, V] float32 a
    # sequence (1 GB at 1,024 steps of a 248K vocabulary), too many to hold beside the model in device memory
    with tempfile.TemporaryDirectory(prefix="gate-reference-") as tmp:
        files = dict(zip(unique, reference_files(path, sequences, starts, steps, Path(tmp))))

        def against(spec: tuple[int, int], logits: mx.array) -> TierScore:
            return score(load_reference(files[spec]), logits)

        exact = {widest: {spec: against(spec, runs.pop(spec)) for spec in specs[widest]}}

        def scored(r: int, tier: str, starts: dict) -> dict:
            out = {}
            for b in range(0, len(specs[r]), r):
                batch = specs[r][b : b + r]
                say(f"{tier} tier: {r} row{'s' * (r > 1)} forced, batch {b // r + 1}/{len(specs[r]) // r}")
                runs = forced(
                    model,
                    [prompts[s] for s in batch],
                    [tokens[s] for s in batch],
                    [starts[s].copy() if s in starts else None for s in batch],
                )
                for spec, logits in zip(batch, runs):
                    out[spec] = against(spec, logits)
            return out

        for r in rows:
            if r != widest:
                exact[r] = scored(r, EXACT, prefilled)
        del prefilled
        fast_set = install(model, fast, family=config.get("model_type"))
        try:
            fast_scores = {r: scored(r, FAST, {}) for r in rows}
        finally:
            install(model, KernelConfig(EXACT))
    return [
        GateResult(
            r,
            steps,
            tuple(PromptGate(n, s, exact[r][(n, s)], fast_scores[r][(n, s)]) for n, s in specs[r]),
            fast_set.as_record(),
        )
        for r in rows
    ]


def run_gate(path: Path, rows: int = 1, **kwargs) -> GateResult:
    """`run_gates` at one row count."""
    return run_gates(path, (rows,), **kwargs)[0]
