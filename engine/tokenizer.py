"""The engine's tokenizer: transformers' AutoTokenizer, loaded the way mlx-lm loads it.

Using the same loader as the oracle means a text prompt becomes the same ids
in our engine and in mlx-lm (tests check this against `mlx_lm.load`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, path: str | Path, eos_token_ids: Iterable[int] = ()):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        logging.getLogger("transformers").setLevel(logging.ERROR)
        from transformers import AutoTokenizer

        self._hf = AutoTokenizer.from_pretrained(str(path))
        self.eos_ids: frozenset[int] = frozenset(eos_token_ids) | (
            frozenset([self._hf.eos_token_id]) if self._hf.eos_token_id is not None else frozenset()
        )

    @property
    def vocab_size(self) -> int:
        return len(self._hf)

    def vocab(self) -> dict[str, int]:
        """Every token string with its id, added tokens included."""
        return self._hf.get_vocab()

    def max_token_chars(self) -> int:
        """An upper bound on the characters one token stands for: its longest vocabulary string (byte-level
        and SentencePiece forms spell each byte or character at least once). A text of n characters encodes
        to at least n / this many tokens, which lets a server refuse a prompt far over its context without
        tokenizing it."""
        if not hasattr(self, "_max_token_chars"):
            self._max_token_chars = max(map(len, self.vocab()), default=1) or 1
        return self._max_token_chars

    @property
    def has_chat_template(self) -> bool:
        return self._hf.chat_template is not None

    @property
    def backend(self) -> Any:
        """The Hugging Face tokenizer underneath, for libraries that take one (llguidance)."""
        return self._hf

    @property
    def chat_template(self) -> str | None:
        """The template `apply_chat_template` renders (a model's own, or one set with `use_chat_template`)."""
        template = self._hf.chat_template
        return template if isinstance(template, str) or template is None else str(template)

    def use_chat_template(self, template: str) -> None:
        """Render chats with this Jinja template in place of the model's (`engine serve --chat-template`)."""
        self._hf.chat_template = template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int]) -> str:
        return self._hf.decode(list(ids))

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        """The chat's token ids; `tools` (OpenAI function entries) go to the template, which may render them, and
        `template_kwargs` as more variables (`enable_thinking`, ...)."""
        if not self.has_chat_template:
            raise ValueError("this model's tokenizer has no chat template")
        text = self._hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            **(template_kwargs or {}),
        )
        return self.encode(text, add_special_tokens=False)
