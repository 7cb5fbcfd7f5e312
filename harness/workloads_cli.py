"""`harness workloads`: the standard frozen workloads, written to goldens/workloads/."""

from __future__ import annotations

from harness.cli_common import model_source, out, targets


def add_workloads(sub) -> None:
    wl = sub.add_parser(
        "workloads",
        help="write the standard frozen workloads to goldens/workloads/",
        description="Build each model's standard workload (seed 0 unless --workload-seed; every phase `harness run all` "
        "can ask for, long context 4096 included) from its artifact's tokenizer and write it under "
        "goldens/workloads/, where runs pick it up when their settings are covered.",
    )
    model_source(wl)
    wl.add_argument("--workload-seed", type=int, default=0, help="workload seed (default 0)")
    wl.set_defaults(func=cmd_workloads, seed=0)


def cmd_workloads(args) -> int:
    from dataclasses import replace

    from harness.workloads import STANDARD, build, golden_path, save, tokenizer_for

    for name, path in targets(args):
        settings = replace(STANDARD, seed=args.workload_seed)
        encode, sha = tokenizer_for(path)
        workload = build(name, encode, sha, settings)
        dest = golden_path(name, settings)
        save(workload, dest)
        out.print(f"{name}: {dest} sha256 {workload.sha256[:16]}")
    return 0
