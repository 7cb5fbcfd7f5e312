"""`harness run all`: every arm, as a real server process, through the same frozen workload.

Per model and arm: start the server (load-to-ready timed), record the kernel
tier an engine server reports in /stats, sample the RSS of its process tree
throughout, then run the phases in order:

    warmup          one short request, then as many at once as the largest concurrency
                    (kernels compile; on CUDA, per shape)
    probe           greedy, `probe_tokens`, output compared across arms afterwards
    decode          `decode_samples` requests of `tokens` output, one at a time
    chat            single-turn chats through /v1/chat/completions, one at a time (the server's chat template
                    makes the prompt; the first reply is compared across arms, as the probe's is)
    cold            a ~1K-token prompt never seen before (TTFT)
    warm            the same prompt again (TTFT with whatever prefix cache the arm has)
    concurrency-C   C requests at once (aggregate throughput), for each C
    prefix          shared-prefix groups (agents on one system prompt): each group's first request alone,
                    then the rest at once (cached tokens, TTFT cold against warm)
    multiturn       chats through /v1/chat/completions, side by side, each turn's messages the
                    conversation so far (canned replies) and a new user message (TTFT and cached tokens a turn)
    rate-R          open loop: `rate_requests` requests arriving at R requests/s (`arrivals`; gamma gaps
                    of shape `burstiness`), at most `max_concurrency` in flight; the first and last tenth are
                    sent and recorded but left out of the cell's metrics. With `sweep` the rates double until
                    the arm saturates (`arrivals.saturated`) or a cell is a burst (`arrivals.is_burst`); the
                    rates past that are not measured
    staggered       long prompts (`staggered_tokens`) arriving `stagger_s` apart, each decoding while the next
                    prefills (TTFT and prefill rate under load, the decoding rows' TPOT beside a prefill)
    long            a `context`-token prompt, then decode (unless skipped)

Cold, staggered and long cells report their prefill rate: a request's prompt tokens not served from a cache
over its TTFT (median over the cell).

A server the harness did not start (`--arm`) keeps its cache from one run to the next: it is sent the workload
with every prompt but the probe's opened by the run's nonce (`workloads.with_run_nonce`), recorded in the run's
settings and the arm's endpoint.

With `cell_repeats` N, blocks 1 .. N-1 of a run are repetition blocks (`repetitions`): every arm's server starts
again, in alternating arm order, and measures the warm-up and the concurrency and rate cells on the same workload
(a server the harness did not start: under a nonce of the block's own), so that each load cell's aggregate rate
has N measures.

then, for an engine arm that finished its phases, the artifact's held-out perplexity on the tier its server ran,
after the server stops, in a child process (`quality_tokens`, `harness.gates.quality.held_out_score`).

Every timed request asks for a fixed output length (`ignore_eos`). A phase
whose requests fail is retried once with the workload's second set of prompts
(fresh nonces); both attempts are kept. No retry after a limit ended a
request (`--request-timeout` in all, `--stall-timeout` without a byte) or
against a dead server. A server that dies or stalls (a hung server) fails
its phase (with its stderr tail), is stopped, and leaves its remaining
phases not measured; the run goes on with the next arm. A failed phase's
reason quotes the first error line of the server's log (`first_error`).

Every exit path stops every server's process tree: the end of an arm, a
harness error, and a signal. With the CLI's `Interrupts` installed, SIGTERM,
SIGHUP and SIGINT raise `RunInterrupted` (see `Interrupts`); the run is then
recorded as interrupted (the arm in flight too, its remaining cells not
measured), the JSON and the database are written to agree, and the exception
propagates.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import httpx
import numpy as np

from harness.run import cells, counters, provenance, traffic
from harness.run.arms import ArmSpec
from harness.run.arrivals import is_burst, measured, rate_of_phase, saturated
from harness.run.client import STALLED, RequestRecord, Timeouts, stream_completion
from harness.run.interrupts import Interrupts, signal_name
from harness.run.metrics import summarize
from harness.run.records import (
    FAILED,
    FINISHED,
    INTERRUPTED,
    MEASURED,
    NOT_MEASURED,
    RECOVERED,
    RUNNING,
    ArmRun,
    Attempt,
    Cell,
    ModelRun,
    RunRecord,
    db_arm,
    db_cell,
    db_model,
    db_run,
    db_sync,
    open_db,
    write_json,
)
from harness.run.repetitions import repeated_phases
from harness.run.rss import RssSampler
from harness.run.servers import (
    ExternalServer,
    ServerProcess,
    ServerStartError,
    first_error,
    free_port,
    server_memory,
    server_stats,
    since_ready,
    start_server,
    tail,
)
from harness.run.workloads import (
    ATTEMPTS,
    CHAT,
    Workload,
    WorkloadSettings,
    load_or_build,
    phase_names,
    tokenizer_for,
    with_run_nonce,
)

Log = Callable[[str], None]

STOP_GRACE_S = 20  # a healthy server's time to exit after SIGTERM
QUICK_STOP_S = 2  # a hung server's, or any server's once the run is interrupted
CELL_STDERR_CHARS = 2000
# what an engine server first ran or compiled after ready, recorded per cell (`servers.since_ready`), as logged
SINCE_READY = (
    ("new_shapes", "forward shapes new since ready"),
    ("compiled_modules", "kernel modules compiled during the cell"),
)


@dataclass(frozen=True)
class RunSettings:
    tokens: int = 192  # output tokens of every timed request
    probe_tokens: int = 64
    decode_samples: int = 5
    ttft_output_tokens: int = 16  # cold / warm phases measure the prompt, not the decode
    long_output_tokens: int = 64
    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    server_timeout_s: float = 1800
    request_timeout_s: float = 1800  # one whole request
    stall_timeout_s: float = 300  # a request without a byte for this long: the server is taken as hung
    goodput: tuple[tuple[str, float], ...] = ()  # SLOs, (metric, ms): a request meeting all counts as goodput
    slo_target: float = 0.9  # the SLO attainment the summary's highest sustained rate must keep
    quality_tokens: int = 512  # held-out tokens an engine arm's perplexity is measured on (0: none)
    burstiness: float = 1.0  # rate cells' gamma shape: 1 Poisson, below 1 burstier
    max_concurrency: int | None = None  # rate cells: requests in flight at most (None: as they arrive)
    sweep: bool = False  # rate cells stop at the arm's saturation point
    # opens the prompts of the servers the harness did not start (`workloads.with_run_nonce`); None: the Runner
    # draws one, so that no run finds them in a cache an earlier run filled; an earlier run's sends its prompts again
    run_nonce: str | None = None
    cell_repeats: int = 1  # measures of each load cell: block 0 and the repetition blocks (`repetitions`)

    def output_tokens(self, phase: str) -> int:
        return {
            "warmup": 8,
            "probe": self.probe_tokens,
            "cold": self.ttft_output_tokens,
            "warm": self.ttft_output_tokens,
            "long": self.long_output_tokens,
        }.get(phase, self.tokens)

    def repeats(self, phase: str) -> int:
        return self.decode_samples if phase == "decode" else 1

    @property
    def timeouts(self) -> Timeouts:
        return Timeouts(request_s=self.request_timeout_s, stall_s=self.stall_timeout_s)


# and a field for each run option a kind of cell declares, such as the staggered cell's gap between arrivals
RunSettings = cells.with_options(RunSettings, cells.RUN)


@dataclass(frozen=True)
class Block:
    """One pass over the models: a workload seed and the order the arms run in; a repetition block measures only
    the warm-up and the load cells again (`repetitions`)."""

    seed: int
    arms: tuple[ArmSpec, ...]
    is_repetition: bool = False

    def phases(self, workload: WorkloadSettings) -> list[str]:
        names = phase_names(workload)
        return repeated_phases(names) if self.is_repetition else names


def blocks_of(kind: str, seeds: Sequence[int], arms: Sequence[ArmSpec], cell_repeats: int = 1) -> list[Block]:
    """Trials: a block a seed; a run: one block, then cell_repeats - 1 repetition blocks on its seed. Either way
    the arms run in the given order in even blocks and reversed in odd ones."""
    order = lambda i: tuple(arms if i % 2 == 0 else arms[::-1])  # noqa: E731
    if kind == "trials":
        return [Block(seed, order(i)) for i, seed in enumerate(seeds)]
    return [Block(seeds[0], order(i), is_repetition=i > 0) for i in range(cell_repeats)]


def progress_steps(settings: RunSettings, blocks: Sequence[Block], targets: int) -> int:
    """The phases a run will measure and the held-out scores it will take (`Runner(on_phase=...)` calls)."""
    steps = 0
    for block in blocks:
        steps += targets * len(block.arms) * len(block.phases(settings.workload))
        if settings.quality_tokens and not block.is_repetition:
            steps += targets * sum(a.is_engine for a in block.arms)
    return steps


_SCORE = (
    "import json, sys; from harness.gates.quality import held_out_score; "
    "print(json.dumps(held_out_score(sys.argv[1], sys.argv[2], int(sys.argv[3]))))"
)


def _score_apart(model_dir: Path, tier: str, tokens: int) -> dict:
    """`harness.gates.quality.held_out_score` in a child process: the model's copy and the device memory its
    forward took leave with it (an interrupt here ends it too); where it fails, {"error": its last error line}."""
    done = subprocess.run(
        [sys.executable, "-c", _SCORE, str(model_dir), tier, str(tokens)], capture_output=True, text=True
    )
    if done.returncode != 0:
        return {"error": (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


class Runner:
    def __init__(
        self,
        settings: RunSettings,
        out: Path,
        db_path: Path,
        *,
        kind: str = "run",
        label: str | None = None,
        diagnostic: bool = False,
        preflight: dict | None = None,
        log: Log = print,
        on_phase: Callable[[str], None] = lambda _: None,
        interrupts: Interrupts | None = None,
        recheck: Callable[[], dict] | None = None,
    ):
        """`recheck`: the preflight check run again after every measured cell (its record goes into the cell's
        metrics as `preflight`) and once the last arm has stopped (`RunRecord.preflight_end`). Without a run nonce
        in `settings`, a random one (recorded with the settings)."""
        settings = replace(settings, run_nonce=settings.run_nonce or secrets.token_hex(8))
        self.settings, self.out, self.log, self.on_phase = settings, out, log, on_phase
        self.recheck = recheck
        self.outputs = (out, out.with_suffix(".md"), db_path)  # rewritten while the run runs: not its source
        self.interrupts = interrupts or Interrupts()
        self.db = open_db(db_path)
        self.servers: list[ServerProcess] = []  # every server launched, stopped again when the run ends
        self.block_phases: dict[int, list[str]] = {}  # what each block measures (`Block.phases`)
        self.record = RunRecord(
            run_id=uuid.uuid4().hex[:12],
            created=datetime.now(UTC).isoformat(timespec="seconds"),
            kind=kind,
            label=label,
            diagnostic=diagnostic,
            settings=asdict(settings),
            provenance=provenance.collect(self.outputs),
            preflight=preflight or {},
        )

    # ------------------------------------------------------------------ run

    def run(self, targets: Sequence[tuple[str, Path]], blocks: Sequence[Block]) -> RunRecord:
        """Every block, model and arm in order. On an exception (a signal's RunInterrupted too) the run is
        recorded as interrupted or failed, every server is stopped, and the exception propagates."""
        self._save()
        try:
            for b, block in enumerate(blocks):
                for name, model_dir in targets:
                    self._run_model(name, model_dir, b, block)
            self.interrupts.check()
            self.record.status, self.record.finished = FINISHED, True
            self._end_checks()
        except BaseException as e:
            self.record.status, self.record.error = _ended(e, "the run")
            raise
        finally:
            self._close()
        return self.record

    def _end_checks(self) -> None:
        """The machine and the source tree once the last arm stopped: a busy machine or a changed tree marks the
        run (the report withholds its ratios)."""
        if self.recheck is not None:
            self.record.preflight_end = self.recheck()
        self.record.provenance["source_tree_sha256_end"] = provenance.source_tree_sha256(self.outputs)

    def _close(self) -> None:
        with self.interrupts.deferred():
            for server in self.servers:
                server.stop(grace_s=QUICK_STOP_S)  # those stopped already: only a sweep of their process group
            for mrun in self.record.models:
                for arm in mrun.arms:
                    if arm.status == RUNNING:  # the exception came while the arm was being closed
                        arm.status = INTERRUPTED if self.record.status == INTERRUPTED else FAILED
                        arm.error = self.record.error
                    _fill_not_measured(arm, self.block_phases[mrun.block])
                if not mrun.parity:  # the run ended before the model's last arm: the probes that finished
                    _set_parity(mrun)
            write_json(self.record, self.out)
            db_sync(self.db, self.record, self.out)

    def _run_model(self, name: str, model_dir: Path, b: int, block: Block) -> None:
        wl_settings = replace(self.settings.workload, seed=block.seed)
        self.block_phases[b] = block.phases(wl_settings)
        workload, path = load_or_build(name, model_dir, wl_settings)
        mrun = ModelRun(
            name,
            str(model_dir),
            provenance.manifest_sha256(model_dir),
            workload.sha256,
            str(path) if path else None,
            block=b,
            workload_seed=block.seed,
            arm_order=[a.name for a in block.arms],
        )
        self.record.models.append(mrun)
        db_model(self.db, self.record.run_id, mrun)
        nonced = None  # what the servers the harness did not start are sent; a repetition's nonce is its own
        if any(arm.url for arm in block.arms):
            nonce = self.settings.run_nonce + (f"{b:02x}" if block.is_repetition else "")
            nonced = with_run_nonce(workload, tokenizer_for(model_dir)[0], nonce)
        for arm in block.arms:
            self._run_arm(
                mrun,
                arm,
                model_dir,
                nonced if arm.url else workload,
                self.block_phases[b],
                quality=not block.is_repetition,
            )
        _set_parity(mrun)
        db_model(self.db, self.record.run_id, mrun)
        self._save()

    def _run_arm(
        self,
        mrun: ModelRun,
        spec: ArmSpec,
        model_dir: Path,
        workload: Workload,
        phases: list[str],
        quality: bool = True,
    ):
        port = free_port()
        arm = ArmRun(spec.name, spec.command(model_dir, port), spec.env, status=RUNNING)
        self.record.commands[spec.name] = arm.command
        mrun.arms.append(arm)
        db_arm(self.db, self.record.run_id, mrun, arm)
        self._save()
        self.log(f"{mrun.model} / {spec.name}: starting `{' '.join(arm.command)}`")
        server, grace_s = None, STOP_GRACE_S
        try:
            if spec.url:  # a server someone else runs: its model's id goes into every request
                server = ExternalServer.connect(spec.url)
                arm.endpoint = {
                    "url": server.url,
                    "model_id": server.model_id,
                    "run_nonce": workload.run_nonce,
                    "workload_sha256": workload.sha256,
                }
                spec = replace(
                    spec, extra_body={**spec.extra_body, **({"model": server.model_id} if server.model_id else {})}
                )
            else:
                server = start_server(
                    arm.command,
                    port,
                    timeout_s=self.settings.server_timeout_s,
                    env=spec.env,
                    probe=spec.probe,
                    on_launch=self.servers.append,
                    spawning=self.interrupts.deferred,
                )
                arm.load_to_ready_s = round(server.load_to_ready_s, 3)
            self.interrupts.check()
            self._measure(mrun, arm, spec, server, workload, phases)
            if quality and spec.is_engine and self.settings.quality_tokens and arm.status == RUNNING:
                server.stop(grace_s=grace_s)  # its device memory back before the model loads a second time
                self._quality(mrun, arm, model_dir)
        except ServerStartError as e:
            arm.status, arm.error, arm.stderr_tail = FAILED, f"server did not start: {str(e).splitlines()[0]}", str(e)
        except BaseException as e:
            at = f" during phase {phases[len(arm.cells)]}" if len(arm.cells) < len(phases) else ""
            arm.status, arm.error = _ended(e, "the run", at)
            grace_s = QUICK_STOP_S
            raise
        finally:
            with self.interrupts.deferred():
                if server is not None:
                    server.stop(grace_s=QUICK_STOP_S if arm.status == FAILED else grace_s)
                    arm.stderr_tail = tail(server.stderr_path, 4000)
                _fill_not_measured(arm, phases)
                if arm.status == RUNNING:
                    arm.status = MEASURED
                self._finish_arm(mrun, arm)

    def _measure(
        self,
        mrun: ModelRun,
        arm: ArmRun,
        spec: ArmSpec,
        server: ServerProcess,
        workload: Workload,
        phases: list[str],
    ) -> None:
        timeouts = self.settings.timeouts
        rss = RssSampler(server.proc.pid) if server.proc is not None else None  # an external server: not ours to sample
        try:
            with rss or nullcontext(), server.client(timeouts.for_httpx()) as client:
                if spec.is_engine:
                    arm.kernels = server_kernels(client)
                    tier = (arm.kernels or {}).get("tier", "unknown (no /stats)")
                    self.log(f"{mrun.model} / {spec.name}: kernels {tier}")
                sweep_end = None  # why a sweep's higher rates are not measured (saturated, or a burst)
                for phase in phases:
                    if sweep_end is not None and cells.kind_of(phase) is cells.RATE:
                        arm.cells.append(Cell(phase, NOT_MEASURED, f"past the sweep's end ({sweep_end})"))
                        continue
                    self.interrupts.check()
                    self.on_phase(f"{mrun.model} / {spec.name} / {phase}")
                    before = since_ready(client) if spec.is_engine else None
                    read_before = counters.read(client)
                    cell = self._phase(server, client, spec, workload, phase)
                    changed = counters.delta(read_before, counters.read(client) if read_before is not None else None)
                    if changed is not None and cell.metrics:
                        cell.metrics["server_counters"] = changed
                    after = since_ready(client) if before is not None else None
                    for key, what in SINCE_READY:  # first run or compiled in the cell: compilations waited for
                        if after is not None and None not in (before[key], after[key]) and cell.metrics:
                            cell.metrics[key] = after[key] - before[key]
                            if after[key] > before[key] and phase != "warmup":  # CUDA compiles a new shape, a CPU not
                                gpu = key == "new_shapes" and self.record.provenance.get("gpu")
                                self.log(
                                    f"  {phase}: {after[key] - before[key]} {what}"
                                    + (" (compiled on CUDA)" if gpu else "")
                                )
                    if self.recheck is not None and cell.metrics:
                        cell.metrics["preflight"] = self.recheck()
                        for problem in cell.metrics["preflight"].get("problems") or ():
                            self.log(f"  {phase}: the machine was busy after the cell: {problem}")
                    arm.cells.append(cell)
                    gone = _server_gone(server, cell, timeouts)
                    if gone:
                        arm.status, arm.error = FAILED, f"{gone} during phase {phase}"
                        cell.reason = f"{cell.reason or ''}; {arm.error}".strip("; ")
                        cell.stderr_tail = tail(server.stderr_path, CELL_STDERR_CHARS)
                    db_cell(self.db, self.record.run_id, mrun, spec.name, cell)
                    self._save()
                    if gone:
                        break
                    if self.settings.sweep and cells.kind_of(phase) is cells.RATE and _saturated(arm):
                        sweep_end = f"saturated at {phase.split('-', 1)[1]} req/s"
                        self.log(f"  {phase}: the arm saturated; higher rates not measured")
                    elif self.settings.sweep and cells.kind_of(phase) is cells.RATE and _burst(cell):
                        sweep_end = (
                            f"the cell at {phase.split('-', 1)[1]} req/s was a burst: its requests arrived "
                            "within their median E2EL, so more --rate-requests are needed for higher rates"
                        )
                        self.log(
                            f"  {phase}: a burst (arrivals within a request's E2EL), not saturated; higher rates not measured"
                        )
                if spec.is_engine:
                    arm.device_memory = server_memory(client)
        finally:
            if rss is not None:
                arm.peak_rss_bytes, arm.rss_samples = rss.peak_bytes, rss.samples

    def _quality(self, mrun: ModelRun, arm: ArmRun, model_dir: Path) -> None:
        """The artifact's held-out perplexity on the tier the arm's server ran (its /stats), once the server has
        stopped, in a child process: the model's second copy and the device memory its forward took leave with
        it, so that neither this score nor the next arm's server finds the GPU held by the other."""
        tier = (arm.kernels or {}).get("tier") or "auto"
        self.on_phase(f"{mrun.model} / {arm.arm} / held-out perplexity")
        try:
            arm.quality = _score_apart(model_dir, tier, self.settings.quality_tokens)
        except Exception as e:  # noqa: BLE001 - the run's measurements stand without it
            arm.quality = {"error": f"{type(e).__name__}: {e}"}
        got = arm.quality.get("perplexity", arm.quality.get("error"))
        self.log(f"{mrun.model} / {arm.arm}: held-out perplexity {got}")

    def _finish_arm(self, mrun: ModelRun, arm: ArmRun) -> None:
        with self.db.atomic():
            db_arm(self.db, self.record.run_id, mrun, arm)
            for cell in arm.cells:
                db_cell(self.db, self.record.run_id, mrun, arm.arm, cell)
        self._save()
        self.log(f"{mrun.model} / {arm.arm}: {arm.status}" + (f" ({arm.error})" if arm.error else ""))

    # --------------------------------------------------------------- phases

    def _phase(self, server: ServerProcess, client, spec: ArmSpec, workload: Workload, phase: str) -> Cell:
        cell = Cell(phase)
        max_tokens = self.settings.output_tokens(phase)
        timeouts = self.settings.timeouts
        for attempt in range(ATTEMPTS):
            prompts = workload.prompts(phase, attempt) * self.settings.repeats(phase)
            pairs = traffic.request_pairs(phase, attempt, prompts, max_tokens, spec.extra_body)
            start = time.perf_counter()
            self._send(client, phase, pairs, timeouts)
            wall = time.perf_counter() - start
            records = [r for _, r in pairs]
            errors = [r.error for r in records if not r.ok]
            cell.attempts.append(Attempt(attempt, not errors, errors[0] if errors else None, round(wall, 4), records))
            if not errors:
                cell.status = MEASURED if attempt == 0 else RECOVERED
                cell.metrics = self._metrics(phase, records, wall, max_tokens)
                cell.reason = None if attempt == 0 else f"first attempt failed: {cell.attempts[0].error}"
                return cell
            cell.status, cell.reason = FAILED, f"{len(errors)} of {len(records)} requests failed: {errors[0]}"
            cell.stderr_tail = tail(server.stderr_path, CELL_STDERR_CHARS)
            said = first_error(server.stderr_path)  # (an --arm server's log is not ours: none)
            if said:
                cell.reason += f"; the server's log first said: {said[:300]}"
            self.log(f"  {phase}: attempt {attempt + 1} failed: {errors[0][:200]}")
            if any(r.timeout_kind for r in records) or server.exited(within_s=2.0):
                break  # a limit would end the retry the same way; no retry against a dead server
        return cell

    def _send(self, client, phase: str, pairs: list[tuple[dict, RequestRecord]], timeouts: Timeouts) -> None:
        """A phase's requests, sent as the phase sends them (the module docstring)."""
        load = self.settings.workload
        kind = cells.kind_of(phase)
        send = kind.send if kind else cells.ALONE
        if send == cells.OPEN_LOOP:
            at, max_concurrency = kind.arrivals(phase, len(pairs), self.settings)
            traffic.open_loop(client, pairs, at, max_concurrency, timeouts)
        elif send == cells.PREFIX_GROUPS:  # each group's first request computes its prefix, then the others at once
            for g in range(0, len(pairs), load.prefix_group_size):
                stream_completion(client, *pairs[g], timeouts)
                traffic.at_once(client, pairs[g + 1 : g + load.prefix_group_size], timeouts)
        elif send == cells.CHATS:  # the chats side by side, each one's turns one after another
            traffic.chats(client, [pairs[c : c + load.turns] for c in range(0, len(pairs), load.turns)], timeouts)
        else:
            alone = {cells.FIRST_ALONE: 1, cells.AT_ONCE: 0}.get(send, len(pairs))
            for body, rec in pairs[:alone]:
                stream_completion(client, body, rec, timeouts)
            if len(pairs) > alone:  # the rest at once
                traffic.at_once(client, pairs[alone:], timeouts)

    def _metrics(self, phase: str, records: list[RequestRecord], wall: float, max_tokens: int) -> dict:
        """A measured cell's metrics (`metrics.summarize`), over a rate cell's measured window, with what the
        rate, shared-prefix and multi-turn cells add."""
        kind = cells.kind_of(phase)
        window = measured(len(records)) if kind and kind.trimmed else slice(0, len(records))
        kept = records[window]
        span = (max(r.sent_at + r.e2el_ms / 1e3 for r in kept) - min(r.sent_at for r in kept)) if window.start else wall
        metrics = summarize(kept, span, dict(self.settings.goodput)) | {
            "requested_output_tokens": max_tokens,
            "short_outputs": sum((r.output_tokens or 0) != max_tokens for r in records),
        }
        median = lambda values: round(float(np.median(values)), 3)  # noqa: E731
        if kind is cells.RATE:
            metrics |= {
                "offered_rate": rate_of_phase(phase),
                "burstiness": self.settings.burstiness,
                "max_concurrency": self.settings.max_concurrency,
                "measured_requests": [window.start, window.stop],
                "request_throughput": round(len(kept) / span, 4) if span > 0 else None,
            }
        elif kind is cells.MULTITURN:
            turns = self.settings.workload.turns
            by_turn = [records[t::turns] for t in range(turns)]
            metrics |= {
                "turn_ttft_ms": [median([r.ttft_ms for r in rs]) for rs in by_turn],
                "turn_cached_tokens": [int(np.median([r.cached_tokens or 0 for r in rs])) for rs in by_turn],
                "turn_prompt_tokens": [int(np.median([r.prompt_tokens or 0 for r in rs])) for rs in by_turn],
            }
        elif kind and kind.prefill_rate:
            metrics["median_prefill_tps"] = prefill_rate(kept)
        elif kind is cells.PREFIX:
            size = self.settings.workload.prefix_group_size
            rest = [r.ttft_ms for i, r in enumerate(records) if i % size]
            metrics |= {
                "median_first_ttft_ms": median([r.ttft_ms for r in records[::size]]),
                "median_shared_ttft_ms": median(rest) if rest else None,
            }
        return metrics

    def _save(self) -> None:
        write_json(self.record, self.out)
        db_run(self.db, self.record, self.out)


def prefill_rate(records: Sequence[RequestRecord]) -> float | None:
    """Median over the requests of their prompt tokens not served from a cache per second of TTFT."""
    rates = [
        ((r.prompt_tokens or r.prompt_tokens_sent) - (r.cached_tokens or 0)) / (r.ttft_ms / 1e3)
        for r in records
        if r.ok and r.ttft_ms
    ]
    return round(float(np.median(rates)), 1) if rates else None


def _saturated(arm: ArmRun) -> bool:
    """Whether the arm's rate cells so far show it saturated (`arrivals.saturated`)."""
    rates = [c for c in arm.cells if cells.kind_of(c.phase) is cells.RATE and c.status in (MEASURED, RECOVERED)]
    return saturated(
        [c.metrics.get("output_throughput") for c in rates], [c.metrics.get("median_ttft_ms") for c in rates]
    )


def _burst(cell: Cell) -> bool:
    """Whether a measured rate cell was a burst (`arrivals.is_burst`)."""
    if cell.status not in (MEASURED, RECOVERED):
        return False
    ok = next(a for a in cell.attempts if a.ok)
    return is_burst([r.sent_at for r in ok.requests], cell.metrics.get("median_e2el_ms"))


def _server_gone(server: ServerProcess | ExternalServer, cell: Cell, timeouts: Timeouts) -> str | None:
    """Why the arm cannot go on after `cell` (its server died, or stopped answering); None if it can."""
    if not server.alive:
        return f"the server exited (status {server.proc.returncode})"
    if any(r.timeout_kind == STALLED for a in cell.attempts for r in a.requests):
        return f"the server stopped answering (no bytes for {timeouts.stall_s:g} s)"
    return None


def _fill_not_measured(arm: ArmRun, phases: list[str]) -> None:
    """The phases the arm did not reach: not measured, for the reason the arm stopped."""
    assert [c.phase for c in arm.cells] == phases[: len(arm.cells)], (arm.arm, [c.phase for c in arm.cells])
    arm.cells += [Cell(p, NOT_MEASURED, arm.error) for p in phases[len(arm.cells) :]]


def _ended(e: BaseException, what: str, at: str = "") -> tuple[str, str]:
    """(status, error) for whatever ended `what` early: a signal, or a harness error."""
    if isinstance(e, KeyboardInterrupt):
        return INTERRUPTED, f"{what} was interrupted by {signal_name(e)}{at}"
    return FAILED, f"{what} failed{at}: {type(e).__name__}: {e}"


def server_kernels(client: httpx.Client) -> dict | None:
    """The kernel set an engine server reports in /stats (what runs, not what was asked); None if it does not say."""
    kernels = server_stats(client).get("kernels")
    return kernels if isinstance(kernels, dict) else None


def _same_text(a: str, b: str) -> bool:
    # mlx_lm.server's streaming detokenizer drops the space that opens the first token's text;
    # one leading space is the only difference forgiven.
    return a == b or (b.startswith(" ") and a == b[1:]) or (a.startswith(" ") and b == a[1:])


def _set_parity(mrun: ModelRun) -> None:
    mrun.parity = probe_parity(mrun)
    if any(c.phase == CHAT for arm in mrun.arms for c in arm.cells):
        mrun.parity["chat"] = probe_parity(mrun, CHAT)


def probe_parity(mrun: ModelRun, phase: str = "probe") -> dict:
    """The greedy output of `phase`'s first request (the probe's, or the chat cell's) of every arm against the first
    arm that produced one; for the chat cell also the prompt tokens each server's template made of the messages.
    An arm sent other prompts (the chat cell of a server the harness did not start: `workloads.with_run_nonce`) is
    not compared."""
    outputs, nonces = {}, {}
    for arm in mrun.arms:
        cell = next((c for c in arm.cells if c.phase == phase and c.status in (MEASURED, RECOVERED)), None)
        if cell is not None:
            outputs[arm.arm] = next(a for a in cell.attempts if a.ok).requests[0]
            nonces[arm.arm] = "" if phase == "probe" else (arm.endpoint or {}).get("run_nonce") or ""
    if not outputs:
        return {"reference": None, "verdicts": {}}
    ref_name, ref = next(iter(outputs.items()))
    verdicts = {}
    for name, rec in outputs.items():
        if nonces[name] != nonces[ref_name]:
            verdicts[name] = {"match": None, "compared": "not compared: other prompts (the run's nonce opens them)"}
            continue
        both_ids = rec.token_ids is not None and ref.token_ids is not None
        match = rec.token_ids == ref.token_ids if both_ids else _same_text(rec.text, ref.text)
        verdicts[name] = {
            "match": match,
            "compared": "token ids" if both_ids else "text",
            "output_tokens": rec.output_tokens,
        }
        if phase == CHAT:
            verdicts[name] |= {
                "prompt_tokens": rec.prompt_tokens,
                "same_prompt_tokens": rec.prompt_tokens == ref.prompt_tokens,
            }
            match = match and rec.prompt_tokens == ref.prompt_tokens
            verdicts[name]["match"] = match
        if not match:
            a, b = rec.text.removeprefix(" "), ref.text.removeprefix(" ")
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            verdicts[name] |= {
                "first_difference_at_char": at,
                "text": a[max(at - 40, 0) : at + 80],
                "reference_text": b[max(at - 40, 0) : at + 80],
            }
    return {"reference": ref_name, "verdicts": verdicts}
