"""`engine`: run the inference engine from the command line.

engine generate --model tiny-qwen35 --prompt "Hello" --max-tokens 32
engine generate --model-path ~/models/Qwen3-4B-4bit --chat --prompt "Hi"
engine serve --model tiny-qwen35 --port 0
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from engine import env
from engine.allocator import CHOICES, reexec
from engine.errors import USER_ERRORS


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engine", description="An LLM inference engine on MLX.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt",
        description="Generate text for one prompt and print it, then a line of timing to stderr. "
        "Registry names are synthesized on first use (see `harness models list`).",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="registry name, e.g. tiny-qwen35 or qwen27b")
    src.add_argument("--model-path", type=Path, help="an mlx-lm model directory")
    gen.add_argument("--seed", type=int, default=0, help="artifact seed for registry models (default 0)")
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--sample-seed", type=int, default=None, help="seed for sampling (default: random)")
    gen.add_argument("--ignore-eos", action="store_true", help="always generate --max-tokens tokens")
    add_kernels_flag(gen)
    _add_spec_flags(gen)
    gen.set_defaults(func=cmd_generate)
    _add_serve(sub)
    return parser


_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "ki": 1 << 10, "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}


def parse_bytes(text: str) -> int:
    """'4000000', '512MiB', '2GiB', '1.5G' -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?)?b?\s*", text.lower())
    if not m:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4000000, 512MiB, 2GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _buckets(text: str) -> tuple[int, ...] | None:
    """--decode-buckets, --prefill-buckets and --prefill-groups: None for auto, () for off, else the counts."""
    if text == "auto":
        return None
    if text == "off":
        return ()
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        values = ()
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"give auto, off or counts >= 1 separated by commas, got {text!r}")
    return values


def _auto_positive(text: str) -> int | None:
    """auto (None) or a count >= 1."""
    return None if text == "auto" else _positive(text)


def _budget(text: str) -> int | None:
    """--prefill-budget and --prefill-budget-idle: None for auto, 0 for off, else the tokens."""
    if text in ("auto", "off"):
        return None if text == "auto" else 0
    return _positive(text)


def _auto_off_above(floor: float, what: str):
    """A parser of `auto` (None), `off` (0.0) or a number above `floor` (`what` says which, with an example)."""

    def parse(text: str) -> float | None:
        if text in ("auto", "off"):
            return None if text == "auto" else 0.0
        try:
            value = float(text)
        except ValueError:
            value = floor
        if not value > floor:
            raise argparse.ArgumentTypeError(f"give auto, off or {what}, got {text!r}")
        return value

    return parse


_gather_ms = _auto_off_above(0.0, "milliseconds > 0 (such as 2)")  # --gather-ms
_itl_ratio = _auto_off_above(1.0, "a ratio > 1 (such as 2.5)")  # --prefill-itl


def _template_file(path: str) -> str:
    """--chat-template: the Jinja template in FILE."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read the chat template {path!r}: {e}") from None


def _host_list(text: str) -> frozenset[str]:
    names = frozenset(n.strip().lower() for n in text.split(",") if n.strip())
    if not names:
        raise argparse.ArgumentTypeError("give host names separated by commas, or '*' for any")
    return names


def add_kernels_flag(p: argparse.ArgumentParser) -> None:
    """`--kernels {auto,exact,fast}`: the kernel tier the model runs (engine.kernels)."""
    from engine.kernels import AUTO, TIERS
    from engine.kernels.config import DEFAULT_STATE_DTYPE, STATE_DTYPES

    p.add_argument(
        "--kernels",
        choices=TIERS,
        default=AUTO,
        help="kernel tier: exact = MLX's operations, bit-exact with mlx-lm; fast = the engine's custom CUDA kernels "
        "(quantized GEMV, chunked DeltaNet prefill, compiled decode steps), equal to exact up to rounding and "
        "gated against a float32 reference, on MLX's CUDA backend only: elsewhere the exact tier runs and the "
        "reason is printed; auto = fast on CUDA for model families whose numerics gate passed, else exact "
        "(default auto). ENGINE_FUSE and ENGINE_GEMV_LAUNCH tune the fast tier (README)",
    )
    p.add_argument(
        "--state-dtype",
        choices=STATE_DTYPES,
        default=DEFAULT_STATE_DTYPE,
        help="the dtype the fast tier keeps Gated DeltaNet layers' recurrent state in: bfloat16 or float16 "
        "halves its memory and the bytes a batched decode step moves against float32 (the math stays float32; "
        "float16 keeps 3 more bits of each value, bfloat16 a wider range); the exact tier keeps mlx-lm's "
        f"float32 (default {DEFAULT_STATE_DTYPE})",
    )
    p.add_argument(
        "--dense-copies",
        choices=("off", "auto", "all"),
        help="bf16 copies of the fast tier's 4-bit matrices (2 bytes a weight more; qwen27b: 54 GB) for its large "
        "prompt chunks, which then skip dequantizing every matrix: auto = engine serve makes as many as the memory "
        "left after its warm-up holds, all = every copy at load (default: ENGINE_KEEP_DENSE, else off)",
    )
    p.add_argument(
        "--dense-decode-rows",
        type=int,
        metavar="N",
        help="from N rows a decode step's matrix products run on the dense copies (cuBLAS) instead of the 4-bit "
        "kernels; needs --dense-copies (default: ENGINE_DENSE_DECODE_ROWS, else 0: never)",
    )


def kernel_config(args):
    """The KernelConfig of `--kernels`, `--state-dtype`, `--dense-copies`, `--dense-decode-rows` and the documented
    environment variables (the flags win)."""
    from engine.kernels import KernelConfig

    flags = {"state_dtype": args.state_dtype}
    copies, rows = getattr(args, "dense_copies", None), getattr(args, "dense_decode_rows", None)
    if copies is not None:
        flags.update(keep_dense=copies == "all", keep_dense_auto=copies == "auto")
    if rows is not None:
        flags.update(dense_decode_rows=rows)
    return dataclasses.replace(KernelConfig.from_env(args.kernels), **flags)


def _add_spec_flags(p: argparse.ArgumentParser) -> None:
    from engine.speculative.rollback import ROLLBACKS, Rollback

    g = p.add_argument_group(
        "speculative decoding",
        "Draft tokens cheaply, verify them in one target forward; greedy output is unchanged. "
        "Off unless --draft-model or --draft-kind is given.",
    )
    src = g.add_mutually_exclusive_group()
    src.add_argument(
        "--draft-model",
        metavar="NAME",
        help="registry name of a draft model with the target's "
        "tokenizer (e.g. small-qwen35-draft; the target's own name = self-draft)",
    )
    src.add_argument("--draft-model-path", type=Path, metavar="DIR", help="an mlx-lm draft model directory")
    g.add_argument(
        "--draft-kind",
        choices=("draft", "ngram", "mtp"),
        default=None,
        help="draft = the draft model (default when one is given); ngram = prompt lookup; "
        "mtp = the target's Qwen3.5 MTP head",
    )
    g.add_argument(
        "--num-draft-tokens", type=_positive, default=3, metavar="N", help="most drafts per round (default 3)"
    )
    g.add_argument("--ngram-min", type=_positive, default=2, metavar="N", help="shortest n-gram to match (default 2)")
    g.add_argument("--ngram-max", type=_positive, default=4, metavar="N", help="longest n-gram to match (default 4)")
    g.add_argument(
        "--draft-policy",
        choices=("adaptive", "fixed"),
        default="adaptive",
        help="adaptive = per round, the draft count with the most expected tokens per second from the "
        "request's measured acceptance and timings, 0 when drafting does not pay (default); "
        "fixed = always --num-draft-tokens (mlx-lm's rule)",
    )
    g.add_argument(
        "--spec-rollback",
        choices=ROLLBACKS,
        default=Rollback.TRACE.value,
        help="how recurrent (DeltaNet) layers undo rejected drafts: trace = keep the state recorded after "
        "the last accepted token (default); replay = restore and feed the kept tokens again (the spec lane "
        "only: spec rows in the batch, --spec-batch, always keep the traced state)",
    )


def spec_config(args):
    """The SpecConfig the flags ask for, or None when speculation is off."""
    from engine.speculative.config import SpecConfig

    kind = args.draft_kind
    if kind is None and (args.draft_model or args.draft_model_path):
        kind = "draft"
    if kind is None:
        return None
    return SpecConfig(
        kind,
        num_draft=args.num_draft_tokens,
        ngram_min=args.ngram_min,
        ngram_max=args.ngram_max,
        rollback=args.spec_rollback,
        policy=args.draft_policy,
    )


def _add_serve(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible server",
        description="Serve a model over HTTP: POST /v1/completions, /v1/chat/completions (SSE with stream: true), "
        "GET /v1/models, /health, /stats, /metrics (Prometheus). The port is bound first; /health answers 503 "
        "until the model is loaded and warm, then 200, and 'engine serve: ready on http://HOST:PORT' is printed. "
        "Stops cleanly on SIGINT/SIGTERM. See the README for the request extensions and limits.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="registry name, e.g. tiny-qwen35 or qwen27b (synthesized on first use)")
    src.add_argument("--model-path", type=Path, help="an mlx-lm model directory")
    p.add_argument("--seed", type=int, default=0, help="artifact seed for registry models (default 0)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument(
        "--allocator",
        choices=CHOICES,
        default="auto",
        help="the host's memory allocator: mimalloc (preloaded: the command runs itself again with LD_PRELOAD set) "
        "takes 20-30%% off the host's time an MLX operation; auto (the default) uses it where the cmeel-mimalloc "
        "package is installed (a dependency on Linux), system keeps glibc's malloc",
    )
    p.add_argument("--port", type=int, default=8000, help="port to bind; 0 picks a free one (default 8000)")
    p.add_argument(
        "--batch",
        type=_positive,
        default=None,
        help="most requests decoding together; 1 = strict serial, bit-exact with mlx-lm B=1 (default 64 "
        "on CUDA, where the fast tier's kernels take up to 64 rows; 8 elsewhere)",
    )
    p.add_argument(
        "--decode-buckets",
        type=_buckets,
        default=None,
        metavar="auto|off|N,N,...",
        help="row counts the continuous lane's decode steps take, the batch filled with ghost rows up "
        "to the next one, so each shape compiles once (auto, the default: 1,2,4,... up to --batch on "
        "the fast tier, off on the exact tier, which stays bit-exact with mlx-lm at every row count)",
    )
    p.add_argument(
        "--prefill-buckets",
        type=_buckets,
        default=None,
        metavar="auto|off|N,N,...",
        help="prompt chunk lengths a prefill forward is padded up to, so each compiles once (auto, the "
        "default: 16, 24, 32, 48, ... up to --prefill-chunk on the fast tier, at most 1.5x the tokens; "
        "off on the exact tier)",
    )
    p.add_argument(
        "--prefill-groups",
        type=_buckets,
        default=None,
        metavar="auto|off|N,N,...",
        help="counts of prompts prefilled together, a group filled with ghost prompts up to the next "
        "one, so each compiles once (auto, the default: 1, 2, 4, ... up to --prefill-batch on the fast "
        "tier, at most 2x the rows; off on the exact tier)",
    )
    p.add_argument(
        "--prefill-batch",
        type=_auto_positive,
        default=None,
        metavar="auto|N",
        help="most prompts prefilled together on the continuous lane (auto, the default: 32 on the fast "
        "tier, so a burst shares a few large forwards; 8 elsewhere, as mlx_lm.server)",
    )
    p.add_argument(
        "--prefill-budget",
        type=_budget,
        default=None,
        metavar="auto|off|N",
        help="prompt tokens all prefilling requests take in one step, shared equally, so that a burst "
        "of long prompts cannot hold decoding rows for long (auto, the default: --prefill-chunk on the "
        "fast tier; off on the exact tier: --prefill-chunk each, as mlx-lm)",
    )
    p.add_argument(
        "--prefill-budget-idle",
        type=_budget,
        default=None,
        metavar="auto|off|N",
        help="the same while no request decodes (no row waits behind the forward), if larger: a burst "
        "reaching an idle server prefills in fewer, larger forwards (auto, the default: twice "
        "--prefill-budget on the fast tier; off: --prefill-budget)",
    )
    p.add_argument(
        "--prefill-itl",
        type=_itl_ratio,
        default=None,
        metavar="auto|off|R",
        help="prefill pacing: while rows decode, a prompt prefills in pieces small enough that the gap "
        "between two of a decoding row's tokens stays within R decode steps, measured as the server runs "
        "(looser in proportion where more prompts wait for their first token than rows decode) "
        "(auto, the default: 3 on the fast tier without --kv-bits; off on the exact tier: a whole "
        "--prefill-budget share a step, as mlx-lm)",
    )
    p.add_argument(
        "--gather-ms",
        type=_gather_ms,
        default=None,
        metavar="auto|off|MS",
        help="requests reaching an idle server: keep taking arrivals until none came for MS milliseconds and "
        "none is still being read (at most 50 times MS), so a burst starts as one prefill group rather than its "
        "first request alone "
        "(auto, the default: 2 on the fast tier; off on the exact tier, as mlx_lm.server)",
    )
    p.add_argument(
        "--warmup",
        choices=("full", "quick", "off"),
        default=None,
        help="before /health says ready: full runs every decode row count, a prompt of each prefill "
        "bucket and one of three chunks, and each prefill group bucket at the chunks it can take, then "
        "empties MLX's buffer cache; quick one request a lane, off none (default full on CUDA, quick "
        "elsewhere)",
    )
    p.add_argument("--prefill-chunk", type=_positive, default=2048, help="prompt tokens per forward (default 2048)")
    p.add_argument(
        "--kv-budget",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="admit requests while their projected KV cache fits (e.g. 8GiB; default: unlimited)",
    )
    p.add_argument(
        "--prompt-cache-bytes",
        type=parse_bytes,
        default="2GiB",
        metavar="BYTES",
        help="prefix cache shared by all requests; 0 disables (default 2GiB)",
    )
    p.add_argument(
        "--prompt-cache-block",
        type=_non_negative,
        default=256,
        metavar="N",
        help="on models whose caches cannot rewind (Gated DeltaNet, sliding windows), keep their state "
        "every N prompt tokens, so a prompt sharing a prefix with an earlier one starts from the last such "
        "boundary inside it; 0 keeps only whole requests' boundaries (default 256)",
    )
    p.add_argument(
        "--prompt-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="the prompt cache's disk tier: entries evicted from RAM and all of them at shutdown are "
        "written here, per model artifact and kernel tier, and a restart finds them (default: RAM only)",
    )
    p.add_argument(
        "--prompt-cache-disk-bytes",
        type=parse_bytes,
        default="16GiB",
        metavar="BYTES",
        help="what the disk tier may hold; the oldest entries go first (default 16GiB)",
    )
    p.add_argument(
        "--chat-template",
        type=_template_file,
        default=None,
        metavar="FILE",
        help="render chats with this Jinja template in place of the model's (one that renders `tools` "
        "with <tool_call> blocks, as Qwen's do, turns on tool-call parsing)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=("auto", "none"),
        default="auto",
        help="auto (the default): where the chat template thinks (<think> blocks), the reply's reasoning "
        "goes to reasoning_content; none: it stays in content",
    )
    p.add_argument(
        "--max-context",
        type=_positive,
        default=None,
        metavar="N",
        help="prompt + completion tokens at most (default: the model's max_position_embeddings)",
    )
    p.add_argument(
        "--max-tokens",
        type=_positive,
        default=512,
        help="completion tokens when a request names none (default 512, capped by the context)",
    )
    p.add_argument(
        "--kv-bits",
        type=int,
        choices=(4, 8),
        default=None,
        help="affine-quantized KV cache from the first token (the prompt cache then serves starts "
        "past a prompt's first prefill chunk, which attends to full-precision keys)",
    )
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64)
    p.add_argument(
        "--api-key",
        default=env.api_key(),
        help="require 'Authorization: Bearer KEY' on every route but /health (default: $ENGINE_API_KEY, else no key)",
    )
    p.add_argument(
        "--allowed-hosts",
        type=_host_list,
        default=None,
        metavar="NAMES",
        help="Host header names accepted, comma-separated, '*' for any (default: the loopback names "
        "for a loopback --host, that address and the loopback names for another, any for 0.0.0.0)",
    )
    p.add_argument(
        "--max-body-bytes",
        type=parse_bytes,
        default="8MiB",
        metavar="BYTES",
        help="largest request body; larger ones get a 413 unread (default 8MiB)",
    )
    p.add_argument(
        "--max-header-bytes",
        type=parse_bytes,
        default="32KiB",
        metavar="BYTES",
        help="largest request head (request line and headers); a larger one gets a 431 and its "
        "connection closed (default 32KiB)",
    )
    p.add_argument(
        "--max-queued-requests",
        type=_non_negative,
        default=256,
        metavar="N",
        help="requests waiting to start at once; more get a 503 with Retry-After (0: no limit; default 256)",
    )
    p.add_argument(
        "--max-queued-tokens",
        type=_non_negative,
        default=0,
        metavar="N",
        help="prompt tokens waiting to start at once, as --max-queued-requests (0: no limit, the default)",
    )
    p.add_argument(
        "--kernel-cache-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="where compiled CUDA kernels are kept, MLX's and the engine's (compiled in parallel at "
        "the start), so a restart compiles none (sets MLX_PTX_CACHE_DIR; default: $MLX_PTX_CACHE_DIR, "
        "else ~/.cache/engine-harness/kernels/mlx-<version>)",
    )
    p.add_argument(
        "--mlx-cache",
        type=parse_bytes,
        default=None,
        metavar="BYTES",
        help="device memory MLX keeps for reuse once freed (its cache limit; default 64GiB on CUDA, at most "
        "half the GPU, so that other processes on the GPU can load; MLX's own elsewhere)",
    )
    add_kernels_flag(p)
    _add_spec_flags(p)
    p.add_argument(
        "--spec-batch",
        action="store_true",
        help="speculate inside the continuous batch: with --draft-kind ngram or mtp or a draft model (--draft-model), "
        "on models whose caches can roll back rows (full attention, DeltaNet), each request that can speculate decodes "
        "as a spec row beside the plain "
        "rows, drafting --num-draft-tokens a round; other requests and draft sources run as without it, and each "
        "result's lane_reason says which (default off: speculation runs alone on the spec lane)",
    )
    p.set_defaults(func=cmd_serve)


def use_kernel_cache(directory: Path | None, environ=None) -> Path:
    """The compiled-kernel cache directory (created): `directory`, else MLX_PTX_CACHE_DIR where set, else
    `env.kernels_dir()`; MLX_PTX_CACHE_DIR points MLX at it, before its first compilation (MLX's CUDA backend
    reads it once). The engine's own kernels are compiled into it too (`engine.kernels.kernel_cache`)."""
    import os

    environ = os.environ if environ is None else environ
    if directory is None:
        directory = Path(environ["MLX_PTX_CACHE_DIR"]) if environ.get("MLX_PTX_CACHE_DIR") else env.kernels_dir()
    directory = directory.expanduser()
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"--kernel-cache-dir {directory}: {e.strerror or e}") from None
    environ["MLX_PTX_CACHE_DIR"] = str(directory)
    return directory


def enable_kernel_cache(directory: Path | None) -> Path:
    """`use_kernel_cache`, and on CUDA the process's kernel builds compiled into it ahead of MLX, in parallel
    (`engine.kernels.kernel_cache`): for in-process tools, before anything is loaded."""
    from engine.kernels import on_cuda
    from engine.kernels.cuda_source import BUILDS

    directory = use_kernel_cache(directory)
    if on_cuda():
        BUILDS.enable_cache(directory)
    return directory


def cmd_serve(args) -> int:
    from engine.device import serve_environment
    from engine.server.main import ServeConfig, serve

    serve_environment()
    kernel_cache_dir = use_kernel_cache(args.kernel_cache_dir)

    return serve(
        ServeConfig(
            model=args.model,
            model_path=args.model_path,
            seed=args.seed,
            host=args.host,
            port=args.port,
            batch=args.batch,
            prefill_chunk=args.prefill_chunk,
            kv_budget=args.kv_budget,
            prompt_cache_bytes=args.prompt_cache_bytes,
            prompt_cache_block=args.prompt_cache_block,
            prompt_cache_dir=args.prompt_cache_dir,
            prompt_cache_disk_bytes=args.prompt_cache_disk_bytes,
            max_context=args.max_context,
            chat_template=args.chat_template,
            reasoning_parser=args.reasoning_parser,
            kv_bits=args.kv_bits,
            kv_group_size=args.kv_group_size,
            api_key=args.api_key,
            max_tokens=args.max_tokens,
            kernels=kernel_config(args),
            spec=spec_config(args),
            spec_batch=args.spec_batch,
            draft_model=args.draft_model,
            draft_model_path=args.draft_model_path,
            max_body_bytes=args.max_body_bytes,
            max_header_bytes=args.max_header_bytes,
            allowed_hosts=args.allowed_hosts,
            max_queued_requests=args.max_queued_requests or None,
            max_queued_tokens=args.max_queued_tokens or None,
            decode_buckets=args.decode_buckets,
            prefill_buckets=args.prefill_buckets,
            prefill_groups=args.prefill_groups,
            prefill_batch=args.prefill_batch,
            prefill_budget=args.prefill_budget,
            idle_prefill_budget=args.prefill_budget_idle,
            prefill_itl=args.prefill_itl,
            gather_ms=args.gather_ms,
            warmup=args.warmup,
            kernel_cache_dir=kernel_cache_dir,
            mlx_cache=args.mlx_cache,
        )
    )


def cmd_generate(args) -> int:
    from engine.engine import Engine, kernels_notice
    from engine.request import SamplingParams

    if args.max_tokens < 1:
        raise ValueError("--max-tokens must be at least 1")
    eng = Engine.load(args.model, args.model_path, seed=args.seed, kernels=kernel_config(args))
    notice = kernels_notice(eng.kernels)
    if notice:
        print(notice, file=sys.stderr)
    tok = eng.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": args.prompt}]) if args.chat else tok.encode(args.prompt)
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p, seed=args.sample_seed
    )
    sampling.validate(tok.vocab_size)
    spec = spec_config(args)
    stats = None
    if spec is not None:
        from engine.request import StopCriteria
        from engine.speculative.config import load_speculation

        speculation = load_speculation(spec, eng, args.draft_model, args.draft_model_path, seed=args.seed)
        stats = speculation.new_stats()
        stop = StopCriteria(max_tokens=args.max_tokens, eos_ids=eng.eos_ids, ignore_eos=args.ignore_eos)
        tokens = speculation.generate(ids, sampling, stop, stats)
    else:
        tokens = eng.generate(ids, max_tokens=args.max_tokens, sampling=sampling, ignore_eos=args.ignore_eos)
    start = time.perf_counter()
    first_at, out_ids, finish = None, [], None
    for t in tokens:
        first_at = first_at or time.perf_counter()
        finish = t.finish_reason
        if not t.is_stop:
            out_ids.append(t.token_id)
    end = time.perf_counter()
    print(tok.decode(out_ids))
    decode_tps = (len(out_ids) - 1) / (end - first_at) if len(out_ids) > 1 and first_at else float("nan")
    print(
        f"[{len(ids)} prompt tokens, {len(out_ids)} generated, TTFT {(first_at - start) * 1000:.0f} ms, "
        f"decode {decode_tps:.1f} tok/s, kernels {eng.kernels.tier}, finish: {finish.value if finish else '-'}]",
        file=sys.stderr,
    )
    if stats is not None:
        print(
            f"[speculation {stats.kind}: {stats.accepted}/{stats.drafted} drafts accepted "
            f"({stats.acceptance:.0%}) in {stats.rounds} rounds, {stats.replays} replays, "
            f"{stats.tokens_per_target_forward:.2f} tokens per target forward]",
            file=sys.stderr,
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if argv is None and getattr(args, "allocator", None):
            reexec(args.allocator, sys.argv[1:])  # a command, not a call: it may run itself again preloaded
        return args.func(args)
    except (*USER_ERRORS, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
