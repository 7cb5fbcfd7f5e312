"""Decoding constrained to a grammar (llguidance): JSON schemas and forced tool calls.

A `Constraint` is a compiled grammar a request carries in its sampling settings; each row that decodes it
gets its own matcher (`Constraint.processor`), a logits processor like the penalties: it feeds the matcher
the tokens the row has generated since its last call, asks for the mask of tokens the grammar allows
next, and sets every other logit to -inf. Once the grammar is complete only the end-of-sequence tokens
are allowed, so the row stops there. It runs on every lane the processors run on (the serial lane and each
row of the continuous batch); the speculative lane refuses processors.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional, Sequence

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

    def processor(self) -> "_Matcher":
        import llguidance

        return _Matcher(llguidance.LLMatcher(self.tokenizer, self.grammar, log_level=0), self.vocab_size)


class _Matcher:
    """One row's matcher as a logits processor (history [T], logits [1, V]) -> logits."""

    def __init__(self, matcher, vocab_size: int):
        import llguidance.numpy as lnp

        self.matcher, self.vocab_size, self._fill = matcher, vocab_size, lnp.fill_next_token_bitmask
        self.bitmask = lnp.allocate_token_bitmask(1, vocab_size)
        self.seen: Optional[int] = None  # history length at the last call: the prompt at the first

    def __call__(self, history: mx.array, logits: mx.array) -> mx.array:
        if self.seen is not None:  # the tokens fed since the last call: the row's own, sampled under the mask
            for token in history[self.seen :].tolist():
                self.matcher.consume_token(token)
        self.seen = history.size
        self._fill(self.matcher, self.bitmask, 0)
        allowed = np.unpackbits(self.bitmask.view(np.uint8), bitorder="little")[: logits.shape[-1]]
        if allowed.size < logits.shape[-1]:
            allowed = np.pad(allowed, (0, logits.shape[-1] - allowed.size))
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

    def tool_calls(self, tools: Sequence[dict[str, Any]], several: bool = True) -> Constraint:
        """Output that is `<tool_call>` blocks (one, or one or more with `several`), each calling one of
        `tools` (OpenAI function entries) with arguments valid under its parameters."""
        import llguidance

        calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                  "properties": {"name": {"const": t["function"]["name"]},
                                 "arguments": t["function"].get("parameters") or {"type": "object"}}}
                 for t in tools]  # fmt: skip
        schema = {"anyOf": calls} if len(calls) > 1 else calls[0]
        schema = {**schema, "x-guidance": _JSON_OPTIONS}
        lark = (f'start: call{"+" if several else ""}\n'
                f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"\n')  # fmt: skip
        return self._compile(llguidance.LLMatcher.grammar_from_lark(lark))
