"""Speculative decoding against plain decoding on the same target, in process.

Arms (all greedy, fixed output length, fresh caches per request):

    plain            the engine's B=1 generation: the baseline
    self             the target drafts for itself: every draft is its own
                     greedy choice, so acceptance is the upper bound and the
                     speed is what the verify window costs and saves
    draft:NAME       a separate draft model with the target's tokenizer
    ngram            prompt lookup
    ngram-miss       prompt lookup with every drafted token moved off by one:
                     what speculation costs when no draft is accepted
    mtp              the target's Qwen3.5 MTP head

Each block is one frozen natural-text prompt (`text`: the project's corpus at
an offset set by the block's seed, or the block's slice of the trained models'
held-out Python source) run once on every arm, in an order that rotates from
block to block so drift hits every arm alike. Reported per arm: median decode rate
((tokens - 1) / time after the first token), median time to first token,
acceptance and tokens per target forward over all blocks, whether every
block's tokens equal the plain arm's (where not, the earliest token that
differs), and the paired ratio against plain
(geometric mean of per-block ratios with a bootstrap interval and verdict,
harness.run.stats) once there are enough blocks. Also per arm: the median time of one
target forward, a block's decode time over the target forwards that ran in it (a speculating arm's
target_calls, verify windows plus replays; the plain arm's tokens - 1), which puts a verify window's
cost beside a plain step's. The target loads with `kernels` (auto, exact or fast: Engine.load), and
the result names the tier that runs.

With `concurrency` (a list of row counts, `harness spec --concurrency 1,4,8`)
each arm instead runs N requests at once through the continuous batcher: the
plain arm as plain rows, ngram, ngram-miss, self, draft:NAME and mtp as spec rows
(engine/batch/spec_rows.py, the arm's draft policy; a draft model drafts for
every row at once, speculative/draft_model.py's BatchDraft, and so does the MTP head,
speculative/mtp.py's BatchMTP). Block b's N prompts are
its seed's and the next N - 1 seeds'. A block's rate is the batch's decode rate: every row's tokens after
its first over the time from the last row's first token to the last row's
end; its TTFT the median row's; its time per target forward that span over the most target forwards
any row ran (rows step together, so the longest row's count is the batch's). The paired ratio, acceptance and tokens per
target forward (pooled over the rows, with each row's own in the record) are
reported per row count.

Random weights make a separate draft model or the MTP head agree with the
target rarely: their acceptance here says how the machinery behaves at low
acceptance; the trained models (`trained` tier) give a pair's real one.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx

from engine.batch.batcher import ContinuousBatcher
from engine.batch.scheduler import SchedulerConfig
from engine.batch.spec_rows import SpecRows
from engine.device import device_label
from engine.engine import Engine
from engine.generate import generate
from engine.request import GenerationRequest, SpecStats, StopCriteria
from engine.sinks import CollectingSink
from engine.speculative.config import SpecConfig, Speculation, load_speculation
from engine.speculative.ngram import NgramSource
from harness.bench.native import time_sample
from harness.gates.quality import held_out_ids
from harness.run.stats import geomean, paired
from harness.run.workloads import text_prompt, tokenizer_for

PLAIN = "plain"
MISS = "ngram-miss"


@dataclass(frozen=True)
class SpecArm:
    name: str
    kind: str | None  # None: plain decoding
    draft: str | None = None  # registry name of the draft model (kind "draft")
    miss: bool = False  # every drafted token moved off by one (MissNgramSource)


class MissNgramSource(NgramSource):
    """Prompt lookup's own proposals, each token moved off by one: the lookup costs what it costs, and a draft is
    accepted only where the moved token happens to be the target's."""

    def propose(self, pending: int, limit: int) -> list[int]:
        return [t - 1 if t else 1 for t in super().propose(pending, limit)]


class MissSpeculation(Speculation):
    """The ngram setup with a MissNgramSource per request."""

    def source(self) -> MissNgramSource:
        return MissNgramSource(self.config.ngram_min, self.config.ngram_max)


def parse_arms(text: str, target: str) -> list[SpecArm]:
    """'plain,self,draft:NAME,ngram,ngram-miss,mtp' -> arms; plain is always first (the baseline)."""
    arms = [SpecArm(PLAIN, None)]
    for name in (x.strip() for x in text.split(",") if x.strip()):
        if name == PLAIN:
            continue
        if name == "self":
            arms.append(SpecArm("self", "draft", target))
        elif name.startswith("draft:"):
            arms.append(SpecArm(name, "draft", name.split(":", 1)[1]))
        elif name in ("ngram", "mtp"):
            arms.append(SpecArm(name, name))
        elif name == MISS:
            arms.append(SpecArm(name, "ngram", miss=True))
        else:
            raise ValueError(f"unknown arm {name!r}: use plain, self, draft:NAME, ngram, {MISS} or mtp")
    if len({a.name for a in arms}) != len(arms):
        raise ValueError(f"an arm is named twice in {text!r}")
    return arms


@dataclass(frozen=True)
class SpecBenchConfig:
    prompt_tokens: int = 256
    decode_tokens: int = 128
    blocks: int = 5
    warmup: int = 1
    num_draft: int = 3
    ngram_min: int = 2
    ngram_max: int = 4
    rollback: str = "trace"
    policy: str = "fixed"  # the benchmark's default shows the full draft count's cost; "adaptive" as served
    seed: int = 0
    text: str = "corpus"  # where prompts come from: "corpus" or "held-out" (TEXTS)
    concurrency: tuple[int, ...] = ()  # row counts run through the continuous batcher; () = one request at a time
    kernels: str = "auto"  # the kernel tier asked of Engine.load: auto, exact or fast


TEXTS = ("corpus", "held-out")


def load_arm(arm: SpecArm, cfg: SpecBenchConfig, target: Engine) -> Speculation:
    """A speculating arm's setup on `target`."""
    spec = SpecConfig(arm.kind, cfg.num_draft, cfg.ngram_min, cfg.ngram_max, cfg.rollback, cfg.policy)
    if arm.miss:
        return MissSpeculation(spec, target.model)
    return load_speculation(spec, target, arm.draft)


def block_prompt(encode, text: str, seed: int, length: int) -> list[int]:
    """Block `seed`'s prompt: corpus text at an offset the seed sets, or the seed-th `length`-token slice of the
    held-out text."""
    if text == "corpus":
        return text_prompt(encode, seed, length)
    if text != "held-out":
        raise ValueError(f"text must be one of {', '.join(TEXTS)}, got {text!r}")

    return held_out_ids(SimpleNamespace(encode=encode), (seed + 1) * length)[seed * length : (seed + 1) * length]


@dataclass
class ArmResult:
    arm: str
    kind: str | None
    draft: str | None
    decode_tps: list[float] = field(default_factory=list)  # per block
    ttft_ms: list[float] = field(default_factory=list)
    forward_ms: list[float] = field(default_factory=list)  # per block: decode time / target forwards in it
    same_tokens: list[bool] = field(default_factory=list)  # per block, vs plain
    first_difference: list[int | None] = field(default_factory=list)  # per block: `first_difference`'s
    spec: dict | None = None  # pooled SpecStats over the measured blocks
    row_spec: list[dict] = field(default_factory=list)  # with concurrency: each measured row's own SpecStats

    @property
    def median_decode_tps(self) -> float:
        return statistics.median(self.decode_tps)

    @property
    def median_ttft_ms(self) -> float:
        return statistics.median(self.ttft_ms)

    @property
    def median_forward_ms(self) -> float:
        return statistics.median(self.forward_ms)


@dataclass
class SpecBenchResult:
    model: str
    device: str
    config: SpecBenchConfig
    arms: list[ArmResult]
    seeds: list[int]
    kernels: str  # the tier the target runs (KernelSet.tier)
    rows: int | None = None  # concurrent requests (None: one at a time, the serial lanes)

    def plain(self) -> ArmResult:
        return self.arms[0]

    def ratios(self, arm: ArmResult) -> list[float]:
        return [a / b for a, b in zip(arm.decode_tps, self.plain().decode_tps)]

    def verdict(self, arm: ArmResult):
        return paired("decode tok/s", self.ratios(arm), self.seeds)

    def as_record(self) -> dict:
        out = {
            "model": self.model,
            "device": self.device,
            "kernels": self.kernels,
            "config": asdict(self.config),
            "seeds": self.seeds,
            "arms": [],
        }
        if self.rows is not None:
            out["rows"] = self.rows
        for a in self.arms:
            rec = {
                **asdict(a),
                "median_decode_tps": a.median_decode_tps,
                "median_ttft_ms": a.median_ttft_ms,
                "median_forward_ms": a.median_forward_ms,
            }
            if a is not self.plain():
                rec["decode_ratio_vs_plain"] = geomean(self.ratios(a))
                rec["paired"] = self.verdict(a).as_record()
            out["arms"].append(rec)
        return out


def first_difference(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]]) -> int | None:
    """The earliest token index at which a row of `got` differs from the same row of `want` (a shorter row
    differs where it ends), or None where every row is equal."""
    firsts = [
        next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        for g, w in zip(got, want)
        if g != w
    ]
    return min(firsts) if firsts else None


def run_spec_bench(
    model: str,
    arms: Sequence[SpecArm],
    cfg: SpecBenchConfig,
    on_progress: Callable[[str], None] = lambda _msg: None,
) -> SpecBenchResult:
    target = Engine.load(model, kernels=cfg.kernels)
    encode, _ = tokenizer_for(target.path)
    setups = {a.name: load_arm(a, cfg, target) for a in arms if a.kind is not None}
    stop = StopCriteria(max_tokens=cfg.decode_tokens, ignore_eos=True)

    def runner(arm: SpecArm, prompt: list[int], stats_out: list) -> Callable[[], Iterator[int]]:
        if arm.kind is None:
            return lambda: (t.token_id for t in generate(target.model, prompt, stop=stop))
        setup = setups[arm.name]
        stats = setup.new_stats()
        stats_out.append(stats)
        return lambda: (t.token_id for t in setup.generate(prompt, stop=stop, stats=stats))

    warm = block_prompt(encode, cfg.text, cfg.seed + cfg.blocks, cfg.prompt_tokens)
    for arm in arms:
        on_progress(f"warming up {arm.name}")
        for _ in range(cfg.warmup):
            time_sample(arm.name, runner(arm, warm, []))
    results = [ArmResult(a.name, a.kind, a.draft) for a in arms]
    pooled = {a.name: SpecStats(a.kind, cfg.num_draft) for a in arms if a.kind is not None}
    seeds = [cfg.seed + b for b in range(cfg.blocks)]
    for b, seed in enumerate(seeds):
        prompt = block_prompt(encode, cfg.text, seed, cfg.prompt_tokens)
        order = list(range(len(arms)))
        order = order[b % len(order) :] + order[: b % len(order)]
        tokens: dict[str, tuple[int, ...]] = {}
        for i in order:
            arm = arms[i]
            on_progress(f"block {b + 1}/{cfg.blocks}: {arm.name}")
            stats_out: list[SpecStats] = []
            sample = time_sample(arm.name, runner(arm, prompt, stats_out))
            tokens[arm.name] = sample.tokens
            results[i].decode_tps.append((len(sample.tokens) - 1) / sample.decode_s)
            results[i].ttft_ms.append(sample.ttft_s * 1000)
            forwards = stats_out[0].target_calls if stats_out else len(sample.tokens) - 1
            results[i].forward_ms.append(sample.decode_s * 1000 / forwards)
            for s in stats_out:
                pooled[arm.name].add(s)
        for r in results:
            r.same_tokens.append(tokens[r.arm] == tokens[PLAIN])
            r.first_difference.append(first_difference([tokens[r.arm]], [tokens[PLAIN]]))
    for r in results:
        if r.arm in pooled:
            r.spec = pooled[r.arm].as_dict()
    return SpecBenchResult(model, device_label(), cfg, results, seeds, target.kernels.tier)


@dataclass
class _TimedSink(CollectingSink):
    """Keeps every token and when it arrived."""

    stamps: list[float] = field(default_factory=list)

    def on_token(self, token):
        self.stamps.append(time.perf_counter())
        return super().on_token(token)


def run_concurrent_bench(
    model: str,
    arms: Sequence[SpecArm],
    cfg: SpecBenchConfig,
    on_progress: Callable[[str], None] = lambda _msg: None,
    on_results: Callable[[list[SpecBenchResult]], None] = lambda _results: None,
) -> list[SpecBenchResult]:
    """One result per row count in `cfg.concurrency`: every arm with that many requests at once in the batcher.
    `on_results` gets the results so far after each block (a long run's finished blocks kept if it stops)."""
    target = Engine.load(model, kernels=cfg.kernels)
    encode, _ = tokenizer_for(target.path)
    setups = {a.name: load_arm(a, cfg, target) for a in arms if a.kind is not None}
    stop = StopCriteria(max_tokens=cfg.decode_tokens, ignore_eos=True)

    def batch(arm: SpecArm, prompts: list[list[int]]) -> tuple[list[_TimedSink], float, float, float]:
        """The rows' sinks, the batch's decode rate, the median row's TTFT (ms) and the time (ms) of one target
        forward of the batch: the decode span over the most target forwards any row ran."""
        setup = setups.get(arm.name)
        spec = None if setup is None else SpecRows(target.model, setup.source, arm.kind, cfg.num_draft, cfg.policy)
        b = ContinuousBatcher(target.model, SchedulerConfig(max_rows=len(prompts)), spec=spec)
        sinks = [_TimedSink() for _ in prompts]
        mx.synchronize()
        start = time.perf_counter()
        for i, (prompt, sink) in enumerate(zip(prompts, sinks)):
            b.submit(GenerationRequest(f"{arm.name}-{i}", tuple(prompt), stop=stop), sink, spec=spec is not None)
        while b.has_work:
            b.step()
        mx.synchronize()
        first = max(s.stamps[0] for s in sinks)
        end = max(s.stamps[-1] for s in sinks)
        rate = sum(len(s.stamps) - 1 for s in sinks) / (end - first)
        if spec is None:
            forwards = max(len(s.stamps) - 1 for s in sinks)
        else:
            forwards = max(s.result.spec.target_calls for s in sinks)
        ttft = statistics.median((s.stamps[0] - start) * 1000 for s in sinks)
        return sinks, rate, ttft, (end - first) * 1000 / forwards

    results = []
    seeds = [cfg.seed + b for b in range(cfg.blocks)]
    for n in cfg.concurrency:

        def prompts(block: int, n: int = n) -> list[list[int]]:
            return [block_prompt(encode, cfg.text, cfg.seed + block * n + i, cfg.prompt_tokens) for i in range(n)]

        for arm in arms:
            on_progress(f"{n} rows: warming up {arm.name}")
            for _ in range(cfg.warmup):
                batch(arm, prompts(cfg.blocks))
        out = [ArmResult(a.name, a.kind, a.draft) for a in arms]
        pooled = {a.name: SpecStats(a.kind, cfg.num_draft) for a in arms if a.kind is not None}
        for b in range(cfg.blocks):
            block = prompts(b)
            order = list(range(len(arms)))
            order = order[b % len(order) :] + order[: b % len(order)]
            tokens: dict[str, list[list[int]]] = {}
            for i in order:
                arm = arms[i]
                on_progress(f"{n} rows, block {b + 1}/{cfg.blocks}: {arm.name}")
                sinks, rate, ttft, forward = batch(arm, block)
                tokens[arm.name] = [s.token_ids for s in sinks]
                out[i].decode_tps.append(rate)
                out[i].ttft_ms.append(ttft)
                out[i].forward_ms.append(forward)
                for s in sinks:
                    if s.result.spec is not None:
                        pooled[arm.name].add(s.result.spec)
                        out[i].row_spec.append(s.result.spec.as_dict())
            for r in out:
                r.same_tokens.append(tokens[r.arm] == tokens[PLAIN])
                r.first_difference.append(first_difference(tokens[r.arm], tokens[PLAIN]))
                if r.arm in pooled:
                    r.spec = pooled[r.arm].as_dict()
            done = SpecBenchResult(model, device_label(), cfg, out, seeds[: b + 1], target.kernels.tier, rows=n)
            on_results([*results, done])
        results.append(done)
    return results


def markdown(result: SpecBenchResult | Sequence[SpecBenchResult]) -> str:
    """One table: a serial result's arms, or every row count's arms of a concurrent run (a rows column first)."""
    results = [result] if isinstance(result, SpecBenchResult) else list(result)
    first = results[0]
    c, rows = first.config, first.rows is not None
    title = "Speculative decoding vs plain"
    how = ""
    forward = "a block's decode time over its target forwards"
    if rows:
        title += " in the continuous batch"
        how = (
            "Each block runs N requests at once (plain rows against spec rows); decode tok/s is the batch's, "
            "TTFT the median row's, acceptance and tokens per target forward pooled over the rows. "
        )
        forward = "the batch's decode time over the most target forwards any row ran"
    lines = [
        f"# {title}: {first.model} on {first.device}, {first.kernels} kernels",
        "",
        f"{c.blocks} blocks, {c.prompt_tokens}-token prompts ({c.text} text), {c.decode_tokens} generated tokens "
        f"(greedy, EOS ignored), up to {c.num_draft} drafts per round ({c.policy} policy), {c.rollback} rollback. "
        f"{how}ms / target forward: {forward} (verify windows plus replays, or plain steps), the median over "
        "blocks; ms / verify window: a window that fed drafts, from building its forward to its tokens read and "
        "its rollback done, and draft ms / round: a batched draft's proposing and catching up, each the mean over "
        "all blocks (spec rows only). Ratios: decode rate against plain, "
        "geometric mean of per-block ratios with a 95% bootstrap interval.",
        "",
        "| rows " * rows + "| arm | decode tok/s | vs plain | paired verdict | TTFT ms | acceptance "
        "| tokens / target forward | ms / target forward | ms / verify window | draft ms / round | replays / round "
        "| same tokens as plain |",
        "|---" * rows + "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for a in r.arms:
            s = a.spec or {}
            if a is r.plain():
                ratio, verdict = "1", "baseline"
            else:
                v = r.verdict(a)
                ratio = f"{v.geomean:.3f}"
                ci = f" [{v.ci_low:.3f}-{v.ci_high:.3f}]" if v.ci_low is not None else ""
                verdict = f"{v.verdict}{ci}"
            acc = f"{s['accepted']}/{s['drafted']} ({s['acceptance']:.0%})" if s else "-"
            tpf = f"{s['tokens_per_target_forward']:.2f}" if s else "1.00"
            rep = f"{s['replays'] / s['rounds']:.2f}" if s and s["rounds"] else "-"
            window, draft = (
                f"{v:.2f}" if v is not None else "-" for v in (s.get("ms_per_window"), s.get("draft_ms_per_round"))
            )
            same = f"{sum(a.same_tokens)}/{len(a.same_tokens)}"
            firsts = [i for i in a.first_difference if i is not None]
            if firsts:
                same += f" (first differs at token {min(firsts)})"
            lines.append(
                f"| {r.rows} "
                * rows
                + f"| {a.arm} | {a.median_decode_tps:.2f} | {ratio} | {verdict} | {a.median_ttft_ms:.0f} | {acc} "
                f"| {tpf} | {a.median_forward_ms:.2f} | {window} | {draft} | {rep} | {same} |"
            )
    return "\n".join(lines) + "\n"


def record(result: SpecBenchResult | Sequence[SpecBenchResult]) -> dict:
    """A serial result's record, or a concurrent run's: model, device, config and one record per row count."""
    if isinstance(result, SpecBenchResult):
        return result.as_record()
    first = result[0]
    return {
        "model": first.model,
        "device": first.device,
        "kernels": first.kernels,
        "config": asdict(first.config),
        "concurrency": [r.as_record() for r in result],
    }


def write(result: SpecBenchResult | Sequence[SpecBenchResult], json_path: Path | None, md_path: Path | None) -> None:
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(record(result), indent=2) + "\n")
    if md_path:
        md_path.parent.mkdir(parents=True, exist_ok=True)
        md_path.write_text(markdown(result))
