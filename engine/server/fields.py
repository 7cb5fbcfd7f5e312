"""Which request fields the server takes: those it honours, those of the OpenAI and vLLM request schemas it
accepts and ignores, and everything else, refused.

The rule: a field the server can honour, it honours (`protocol`). A field of OpenAI's or vLLM's request
schema that it cannot honour is accepted and ignored, and named: in `usage.engine.ignored_fields` of that
request and, the first time the server sees it, in its log. A field of neither API is refused with a 400
that names it, so that a typo (`max_token`) is not ignored silently. Three fields whose absence would
change what a reply means are refused unless they ask for nothing: `n` and `best_of` above 1, `suffix`.
"""

from __future__ import annotations

from collections.abc import Iterable

# both endpoints, honoured (protocol.py reads them)
SHARED = frozenset(
    {
        "model",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "min_tokens",
        "stop",
        "stop_token_ids",
        "seed",
        "logit_bias",
        "logprobs",
        "top_logprobs",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "stream",
        "stream_options",
        "ignore_eos",
        "return_token_ids",
        "n",
        "best_of",
        "response_format",
        "guided_json",
        "structured_outputs",
    }
)
COMPLETION = SHARED | {"prompt", "echo", "suffix"}
CHAT = SHARED | {
    "messages",
    "max_completion_tokens",
    "parallel_tool_calls",
    "tools",
    "tool_choice",
    "chat_template_kwargs",
}

# OpenAI's request fields the server accepts and ignores: they ask for a service it has no part of (stored
# completions, tiers, safety identifiers, a cache key for routing), a model feature a local model has no
# setting for (reasoning effort, verbosity, audio, web search, predicted outputs), or the deprecated
# `functions` (tools are the current form)
OPENAI_IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "reasoning_effort",
        "verbosity",
        "modalities",
        "audio",
        "prediction",
        "web_search_options",
        "functions",
        "function_call",
    }
)
# vLLM's extensions the server accepts and ignores
VLLM_IGNORED = frozenset(
    {
        "use_beam_search",
        "length_penalty",
        "include_stop_str_in_output",
        "skip_special_tokens",
        "spaces_between_special_tokens",
        "truncate_prompt_tokens",
        "prompt_logprobs",
        "allowed_token_ids",
        "bad_words",
        "add_special_tokens",
        "add_generation_prompt",
        "continue_final_message",
        "documents",
        "chat_template",
        "mm_processor_kwargs",
        "guided_decoding_backend",
        "guided_whitespace_pattern",
        "priority",
        "request_id",
        "logits_processors",
        "return_tokens_as_token_ids",
        "cache_salt",
        "kv_transfer_params",
        "vllm_xargs",
    }
)
IGNORED = OPENAI_IGNORED | VLLM_IGNORED

# stream_options: include_usage and vLLM's continuous_usage_stats honoured, OpenAI's include_obfuscation
# (random padding against length side channels, for remote clients) accepted and ignored
STREAM_OPTIONS = frozenset({"include_usage", "continuous_usage_stats"})
STREAM_OPTIONS_IGNORED = frozenset({"include_obfuscation"})


def ignored_fields(body: dict, known: Iterable[str]) -> tuple[str, ...]:
    """The body's fields that are neither honoured (`known`) nor refused: ignored, sorted."""
    return tuple(sorted((set(body) - set(known)) & IGNORED))


def unknown_fields(body: dict, known: Iterable[str]) -> list[str]:
    """The body's fields of neither API: refused."""
    return sorted(set(body) - set(known) - IGNORED)
