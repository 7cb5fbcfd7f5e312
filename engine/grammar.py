"""Decoding constrained to a grammar (llguidance): JSON schemas and forced tool calls.

A `Constraint` is a compiled grammar a request carries in its sampling settings; each row that decodes it
gets its own matcher (`Constraint.processor`): fed the tokens the row has generated since its last call,
it gives the mask of tokens the grammar allows next, and every other logit goes to -inf. Once the grammar
is complete only the end-of-sequence tokens are allowed, so the row stops there. On the serial lane it is
a logits processor like the penalties; the continuous batch masks all its constrained rows at once
(`mask_rows`: llguidance fills the masks on its threads, one `where` applies them). The speculative lane
refuses processors.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np

# JSON as models write it: no whitespace between tokens but single spaces, so that a model without a
# preference for one does not wander in whitespace
_JSON_OPTIONS = {"whitespace_flexible": False}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (its message names the problem)."""


@dataclass(frozen=True, eq=False)
class Constraint:
    """A compiled grammar (llguidance's JSON form) over one tokenizer."""

    grammar: str
    tokenizer: Any  # llguidance.LLTokenizer
    vocab_size: int  # the logits' width (the model's embedding rows)

    def processor(self) -> _Matcher:
        import llguidance

        return _Matcher(llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0), self.vocab_size)


class _Matcher:
    """One row's matcher: fed the row's tokens, it gives the mask of tokens allowed next. As a logits processor
    (history [T], logits [1, V]) -> logits it masks one row (the serial lane); `mask_rows` masks a batch's
    constrained rows in one parallel pass."""

    def __init__(self, matcher, vocab_size: int):
        self.matcher, self.vocab_size = matcher, vocab_size
        self.seen: int | None = None  # history length at the last call: the prompt at the first

    def advance(self, history: mx.array) -> None:
        """Feed the tokens the row was fed since the last call (its own, sampled under the mask)."""
        if self.seen is not None:
            for token in history[self.seen :].tolist():
                self.matcher.consume_token(token)
        self.seen = history.size

    @property
    def error(self) -> str | None:
        return self.matcher.get_error() if self.matcher.is_error() else None

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        return mask_rows(logits, [(0, self, history)])


_EXECUTOR = None  # llguidance's thread pool for masks (made on first use)


def mask_rows(logits: mx.array, rows: Sequence[tuple[int, _Matcher, mx.array]]) -> mx.array:
    """logits [B, V] with each listed row (index, matcher, its token history) masked to what its grammar allows
    next; the other rows unchanged. The masks are filled in parallel, off the GIL, and applied in one op."""
    import llguidance
    import llguidance.numpy as lnp

    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor()
    batch, width = logits.shape
    for _, m, history in rows:
        m.advance(history)
    bitmask = lnp.allocate_token_bitmask(batch, rows[0][1].vocab_size)
    bitmask[:] = -1  # rows without a grammar: every token
    lnp.fill_next_token_bitmask_par(_EXECUTOR, [(m.matcher, i) for i, m, _ in rows], bitmask)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, bitorder="little")[:, :width]
    if allowed.shape[1] < width:
        allowed = np.pad(allowed, ((0, 0), (0, width - allowed.shape[1])), constant_values=1)
    return mx.where(mx.array(allowed.astype(np.bool_)), logits, mx.array(-mx.inf, dtype=logits.dtype))


class Grammars:
    """Constraints over one tokenizer (llguidance's view of it built once, on first use)."""

    def __init__(self, hf_tokenizer: Any, eos_ids: Sequence[int], vocab_size: int):
        self._hf, self._eos, self.vocab_size = hf_tokenizer, list(eos_ids), vocab_size
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(self._hf, n_vocab=self.vocab_size, eos_token=self._eos)
        return self._tokenizer

    def _compile(self, grammar: str) -> Constraint:
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar, self.tokenizer)
        if error:
            raise GrammarError(error)
        return Constraint(grammar, self.tokenizer, self.vocab_size)

    def json_schema(self, schema: dict[str, Any]) -> Constraint:
        """Output that is one JSON value valid under `schema`."""
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        except ValueError as e:
            raise GrammarError(str(e)) from None
        return self._compile(grammar)

    def tool_calls(self, tools: Sequence[dict[str, Any]], several: bool = False) -> Constraint:
        """Output that is one `<tool_call>` block calling one of `tools` (OpenAI function entries) with arguments
        valid under its parameters; with `several`, one or more blocks, the reply free to end after each."""
        return self._lark(f"start: {_calls(several)}\n{_call_rule(tools)}")

    def call_or_json(
        self, tools: Sequence[dict[str, Any]], schema: dict[str, Any], several: bool = False
    ) -> Constraint:
        """Output that is either the calls of `tool_calls` or one JSON value valid under `schema`: a reply under
        response_format where tools are offered and not forced."""
        options = {**_JSON_OPTIONS, **(schema.get("x-guidance") or {})}
        reply = f"reply: %json {json.dumps({**schema, 'x-guidance': options})}\n"
        return self._lark(f"start: {_calls(several)} | reply\n{reply}{_call_rule(tools)}")

    def _lark(self, lark: str) -> Constraint:
        import llguidance

        return self._compile(llguidance.LLMatcher.grammar_from_lark(lark))


def _calls(several: bool) -> str:
    # `call+` is accepting after each call, so end-of-sequence is allowed there: a model that would repeat a
    # call can stop instead (it is never forced to write a second)
    return "call+" if several else "call"


def _call_rule(tools: Sequence[dict[str, Any]]) -> str:
    """The lark rule of one `<tool_call>` JSON block calling one of `tools`."""
    calls = [
        {
            "type": "object",
            "additionalProperties": False,
            "required": ["name", "arguments"],
            "properties": {
                "name": {"const": t["function"]["name"]},
                "arguments": t["function"].get("parameters") or {"type": "object"},
            },
        }
        for t in tools
    ]
    schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
    schema = {**schema, "x-guidance": _JSON_OPTIONS}
    return f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"\n'
