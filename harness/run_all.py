"""`harness run all`: every arm, as a real server process, through the same frozen workload.

Per model and arm: start the server (load-to-ready timed), record the kernel
tier an engine server reports in /stats, sample the RSS of its process tree
throughout, then run the phases in order:

    warmup          one short request, then as many at once as the largest concurrency
                    (kernels compile; on CUDA, per shape)
    probe           greedy, `probe_tokens`, output compared across arms afterwards
    decode          `decode_samples` requests of `tokens` output, one at a time
    cold            a ~1K-token prompt never seen before (TTFT)
    warm            the same prompt again (TTFT with whatever prefix cache the arm has)
    concurrency-C   C requests at once (aggregate throughput), for each C
    long            a `context`-token prompt, then decode (unless skipped)

Every timed request asks for a fixed output length (`ignore_eos`). A phase
whose requests fail is retried once with the workload's second set of prompts
(fresh nonces); both attempts are kept. A server that dies fails its phase
(with its stderr tail) and leaves its remaining phases not measured; the run
goes on with the next arm. Every process tree is killed at the end, on
errors and on Ctrl-C.
"""

from __future__ import annotations

import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Optional, Sequence

import httpx

from harness import provenance
from harness.arms import ArmSpec
from harness.client import RequestRecord, stream_completion
from harness.metrics import summarize
from harness.records import (
    FAILED,
    MEASURED,
    NOT_MEASURED,
    RECOVERED,
    ArmRun,
    Attempt,
    Cell,
    ModelRun,
    RunRecord,
    db_arm,
    db_cell,
    db_run,
    open_db,
    write_json,
)
from harness.rss import RssSampler
from harness.servers import ServerProcess, ServerStartError, free_port, start_server, tail
from harness.workloads import ATTEMPTS, Workload, WorkloadSettings, load_or_build, phase_names

Log = Callable[[str], None]


@dataclass(frozen=True)
class RunSettings:
    tokens: int = 192  # output tokens of every timed request
    probe_tokens: int = 64
    decode_samples: int = 5
    ttft_output_tokens: int = 16  # cold / warm phases measure the prompt, not the decode
    long_output_tokens: int = 64
    workload: WorkloadSettings = field(default_factory=WorkloadSettings)
    server_timeout_s: float = 1800
    request_timeout_s: float = 1800

    def output_tokens(self, phase: str) -> int:
        return {"warmup": 8, "probe": self.probe_tokens, "cold": self.ttft_output_tokens,
                "warm": self.ttft_output_tokens, "long": self.long_output_tokens}.get(phase, self.tokens)  # fmt: skip

    def repeats(self, phase: str) -> int:
        return self.decode_samples if phase == "decode" else 1


@dataclass(frozen=True)
class Block:
    """One pass over the models: a workload seed and the order the arms run in."""

    seed: int
    arms: tuple[ArmSpec, ...]


class Runner:
    def __init__(self, settings: RunSettings, out: Path, db_path: Path, *, kind: str = "run",
                 label: Optional[str] = None, diagnostic: bool = False, preflight: Optional[dict] = None,
                 log: Log = print, on_phase: Callable[[str], None] = lambda _: None):  # fmt: skip
        self.settings, self.out, self.log, self.on_phase = settings, out, log, on_phase
        self.db = open_db(db_path)
        self.record = RunRecord(
            run_id=uuid.uuid4().hex[:12],
            created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            kind=kind,
            label=label,
            diagnostic=diagnostic,
            settings=asdict(settings),
            provenance=provenance.collect(),
            preflight=preflight or {},
        )

    # ------------------------------------------------------------------ run

    def run(self, targets: Sequence[tuple[str, Path]], blocks: Sequence[Block]) -> RunRecord:
        self._save()
        for b, block in enumerate(blocks):
            for name, model_dir in targets:
                self._run_model(name, model_dir, b, block)
        self.record.finished = True
        self._save()
        return self.record

    def _run_model(self, name: str, model_dir: Path, b: int, block: Block) -> None:
        wl_settings = replace(self.settings.workload, seed=block.seed)
        workload, path = load_or_build(name, model_dir, wl_settings)
        mrun = ModelRun(name, str(model_dir), provenance.manifest_sha256(model_dir), workload.sha256,
                        str(path) if path else None, block=b, workload_seed=block.seed,
                        arm_order=[a.name for a in block.arms])  # fmt: skip
        self.record.models.append(mrun)
        for arm in block.arms:
            self._run_arm(mrun, arm, model_dir, workload, wl_settings)
        mrun.parity = probe_parity(mrun)
        self._save()

    def _run_arm(self, mrun: ModelRun, spec: ArmSpec, model_dir: Path, workload: Workload, wl: WorkloadSettings):
        port = free_port()
        arm = ArmRun(spec.name, spec.command(model_dir, port), spec.env)
        self.record.commands[spec.name] = arm.command
        mrun.arms.append(arm)
        phases = phase_names(wl)
        self.log(f"{mrun.model} / {spec.name}: starting `{' '.join(arm.command)}`")
        try:
            server = start_server(arm.command, port, timeout_s=self.settings.server_timeout_s, env=spec.env,
                                  probe=spec.probe)  # fmt: skip
        except ServerStartError as e:
            arm.status, arm.error = FAILED, f"server did not start: {str(e).splitlines()[0]}"
            arm.stderr_tail = str(e)
            arm.cells = [Cell(p, NOT_MEASURED, arm.error) for p in phases]
            for cell in arm.cells:
                db_cell(self.db, self.record.run_id, mrun, spec.name, cell)
            self._finish_arm(mrun, arm)
            return
        arm.load_to_ready_s = round(server.load_to_ready_s, 3)
        try:
            with RssSampler(server.proc.pid) as rss, server.client(self.settings.request_timeout_s) as client:
                if spec.is_engine:
                    arm.kernels = server_kernels(client)
                    tier = (arm.kernels or {}).get("tier", "unknown (no /stats)")
                    self.log(f"{mrun.model} / {spec.name}: kernels {tier}")
                for phase in phases:
                    self.on_phase(f"{mrun.model} / {spec.name} / {phase}")
                    if not server.alive:
                        arm.cells.append(Cell(phase, NOT_MEASURED, arm.error))
                        continue
                    cell = self._phase(server, client, spec, workload, phase)
                    arm.cells.append(cell)
                    if not server.alive and arm.error is None:
                        arm.status = FAILED
                        arm.error = f"the server exited (status {server.proc.returncode}) during phase {phase}"
                        cell.reason = f"{cell.reason or ''}; {arm.error}".strip("; ")
                    db_cell(self.db, self.record.run_id, mrun, spec.name, cell)
                    self._save()
            arm.peak_rss_bytes, arm.rss_samples = rss.peak_bytes, rss.samples
        finally:
            server.stop()
            arm.stderr_tail = tail(server.stderr_path, 4000)
        if arm.status != FAILED:
            arm.status = MEASURED
        self._finish_arm(mrun, arm)

    def _finish_arm(self, mrun: ModelRun, arm: ArmRun) -> None:
        db_arm(self.db, self.record.run_id, mrun, arm)
        self._save()
        self.log(f"{mrun.model} / {arm.arm}: {arm.status}" + (f" ({arm.error})" if arm.error else ""))

    # --------------------------------------------------------------- phases

    def _phase(self, server: ServerProcess, client, spec: ArmSpec, workload: Workload, phase: str) -> Cell:
        cell = Cell(phase)
        max_tokens = self.settings.output_tokens(phase)
        for attempt in range(ATTEMPTS):
            prompts = workload.prompts(phase, attempt) * self.settings.repeats(phase)
            bodies = [{"prompt": p, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                       **spec.extra_body} for p in prompts]  # fmt: skip
            records = [RequestRecord(phase, attempt, i, len(p)) for i, p in enumerate(prompts)]
            start = time.perf_counter()
            alone = 1 if phase == "warmup" else (0 if phase.startswith("concurrency-") else len(bodies))
            for body, rec in zip(bodies[:alone], records[:alone]):
                stream_completion(client, body, rec)
            if len(bodies) > alone:  # the rest at once
                with ThreadPoolExecutor(len(bodies) - alone) as pool:
                    list(pool.map(lambda br: stream_completion(client, *br), zip(bodies[alone:], records[alone:])))
            wall = time.perf_counter() - start
            errors = [r.error for r in records if not r.ok]
            cell.attempts.append(Attempt(attempt, not errors, errors[0] if errors else None, round(wall, 4), records))
            if not errors:
                cell.status = MEASURED if attempt == 0 else RECOVERED
                cell.metrics = summarize(records, wall) | {
                    "requested_output_tokens": max_tokens,
                    "short_outputs": sum((r.output_tokens or 0) != max_tokens for r in records),
                }
                cell.reason = None if attempt == 0 else f"first attempt failed: {cell.attempts[0].error}"
                return cell
            cell.status, cell.reason = FAILED, f"{len(errors)} of {len(records)} requests failed: {errors[0]}"
            self.log(f"  {phase}: attempt {attempt + 1} failed: {errors[0][:200]}")
            if server.exited(within_s=2.0):
                break  # no retry against a dead server
        return cell

    def _save(self) -> None:
        write_json(self.record, self.out)
        db_run(self.db, self.record, self.out)


def server_kernels(client: httpx.Client) -> Optional[dict]:
    """The kernel set an engine server reports in /stats (what runs, not what was asked); None if it does not say."""
    try:
        r = client.get("/stats")
        kernels = r.json().get("kernels") if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):  # no answer, not JSON, not an object
        return None
    return kernels if isinstance(kernels, dict) else None


def _same_text(a: str, b: str) -> bool:
    # mlx_lm.server's streaming detokenizer drops the space that opens the first token's text;
    # one leading space is the only difference forgiven.
    return a == b or a.removeprefix(" ") == b.removeprefix(" ")


def probe_parity(mrun: ModelRun) -> dict:
    """The probe's greedy output of every arm against the first arm that produced one."""
    outputs = {}
    for arm in mrun.arms:
        cell = next((c for c in arm.cells if c.phase == "probe" and c.status in (MEASURED, RECOVERED)), None)
        if cell is not None:
            outputs[arm.arm] = next(a for a in cell.attempts if a.ok).requests[0]
    if not outputs:
        return {"reference": None, "verdicts": {}}
    ref_name, ref = next(iter(outputs.items()))
    verdicts = {}
    for name, rec in outputs.items():
        both_ids = rec.token_ids is not None and ref.token_ids is not None
        match = rec.token_ids == ref.token_ids if both_ids else _same_text(rec.text, ref.text)
        verdicts[name] = {"match": match, "compared": "token ids" if both_ids else "text",
                          "output_tokens": rec.output_tokens}  # fmt: skip
        if not match:
            a, b = rec.text.removeprefix(" "), ref.text.removeprefix(" ")
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            verdicts[name] |= {"first_difference_at_char": at, "text": a[max(at - 40, 0) : at + 80],
                               "reference_text": b[max(at - 40, 0) : at + 80]}  # fmt: skip
    return {"reference": ref_name, "verdicts": verdicts}
