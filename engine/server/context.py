"""What the routes serve with once the model is loaded and warm: the worker, the tokenizer and the model's limits.

Below the routes (`app`) and the relays (`relay`, `sse`), which all read it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from engine.grammar import Grammars
from engine.kernels import KernelSet
from engine.server.tool_calls import Parser
from engine.server.worker import EngineWorker
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.server.metrics import Metrics


@dataclass(frozen=True)
class ServerContext:
    worker: EngineWorker
    tokenizer: Tokenizer
    model_id: str
    model_aliases: frozenset[str]  # other names a request may use for the served model
    vocab_size: int  # the model's embedding rows: token ids must be below this
    max_context: int  # prompt + completion tokens at most
    default_max_tokens: int
    api_key: str | None
    created: int
    kernels: KernelSet  # the kernel tier the model runs: in every usage and in /stats
    metrics: Metrics | None = None  # /metrics (None: prometheus_client is not installed)
    tool_parser: Parser | None = None  # the chat template's tool-call format (None: it renders no tools)
    grammars: Grammars | None = None  # constrained decoding (response_format, forced tool calls)
    reasoning: bool = False  # the chat template thinks: <think> blocks go to reasoning_content
    kernel_cache_dir: Path | None = None  # MLX_PTX_CACHE_DIR: /stats counts the modules compiled into it
    modules_at_ready: int | None = None  # how many it held at ready (`kernel_cache.module_files`)
