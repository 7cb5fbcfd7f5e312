"""A byte-level BPE tokenizer that covers a model's vocabulary exactly.

Trained with `tokenizers` on the corpus shipped beside this file, then padded
with pronounceable filler words (" bako", " tize", ...) so that every id in
`[0, vocab_size)` decodes to text.

transformers 5 rebuilds Qwen tokenizers from vocab and merges with its own
normalizer (NFC) and split regex, ignoring the pre-tokenizer in
tokenizer.json; qwen3_5 uses a regex that also keeps combining marks (\\p{M})
with letters. The tokenizer.json written here uses exactly the settings the
loader will use for the model type, so every loader yields the same ids.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from importlib import resources

from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers, trainers
from tokenizers.models import BPE

BASE_BPE_SIZE = 2000  # byte alphabet + merges learned from the corpus

QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN35_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

EOS = "<|im_end|>"
END_OF_TEXT = "<|endoftext|>"
SPECIAL_TOKENS = (END_OF_TEXT, "<|im_start|>", EOS)

# Qwen3's chat format: without tools and with thinking left on, each message as
# "<|im_start|>role\ncontent<|im_end|>\n", then "<|im_start|>assistant\n". With `tools`, a system turn lists
# their signatures and asks for <tool_call> JSON blocks; earlier calls and tool answers render as Qwen's do;
# `enable_thinking=False` closes an empty <think> block after the generation prompt.
CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions. Their signatures:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each call, return a JSON object with the function name and arguments within "
    '<tool_call></tool_call> tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}'
    "\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' and tools and loop.first %}"
    "{%- elif message['role'] == 'assistant' and message.tool_calls %}"
    "{{- '<|im_start|>assistant\\n' + (message['content'] or '') }}"
    "{%- for call in message.tool_calls %}"
    '{{- \'<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{%- if call.function.arguments is string %}{{- call.function.arguments }}"
    "{%- else %}{{- call.function.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)

_CONSONANTS = "bdfgklmnprstvz"
_VOWELS = "aeiou"


@dataclass(frozen=True)
class BuiltTokenizer:
    tokenizer_json: dict
    tokenizer_config: dict
    special_ids: dict[str, int]
    # Ids whose text alone is not complete UTF-8, plus the special tokens:
    # the synthetic weights steer generation away from these.
    suppressed_ids: tuple[int, ...]

    @property
    def eos_ids(self) -> list[int]:
        return [self.special_ids[EOS], self.special_ids[END_OF_TEXT]]


def corpus_text() -> str:
    return resources.files("engine.synth").joinpath("corpus.txt").read_text(encoding="utf-8")


def split_regex(model_type: str) -> str:
    return QWEN35_SPLIT if model_type.startswith("qwen3_5") else QWEN2_SPLIT


def _filler(i: int) -> str:
    """The i-th pronounceable filler word, space-prefixed in byte-level form."""
    word, n = "", i + 1
    base = len(_CONSONANTS) * len(_VOWELS)
    while n > 0:
        n, r = divmod(n, base)
        word += _CONSONANTS[r // len(_VOWELS)] + _VOWELS[r % len(_VOWELS)]
    return "\u0120" + word  # "Ġ" is the byte-level form of a space


def _train_base(model_type: str, texts: Iterable[str] | None = None, size: int = BASE_BPE_SIZE) -> Tokenizer:
    tok = Tokenizer(BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split_regex(model_type)), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(texts if texts is not None else [corpus_text()], trainer=trainer)
    return tok


def _byte_decoder() -> dict[str, int]:
    """Byte-level alphabet character -> byte (the GPT-2 mapping)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, n = {}, 0
    for b in range(256):
        if b in printable:
            mapping[chr(b)] = b
        else:
            mapping[chr(256 + n)] = b
            n += 1
    return mapping


def _is_complete_utf8(token: str, byte_decoder: dict[str, int]) -> bool:
    try:
        bytes(byte_decoder[c] for c in token).decode("utf-8")
    except (KeyError, UnicodeDecodeError):
        return False
    return True


def build_tokenizer(
    model_type: str, vocab_size: int, texts: Iterable[str] | None = None, base_size: int = BASE_BPE_SIZE
) -> BuiltTokenizer:
    """Train the base BPE (`base_size` ids: the byte alphabet and merges learned from `texts`, by default the
    corpus beside this file) and pad it to exactly `vocab_size` ids."""
    min_size = base_size + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size {vocab_size} is below the minimum {min_size}")
    spec = json.loads(_train_base(model_type, texts, base_size).to_str())
    vocab: dict[str, int] = spec["model"]["vocab"]
    byte_decoder = _byte_decoder()
    suppressed = [i for t, i in vocab.items() if not _is_complete_utf8(t, byte_decoder)]

    special_ids, added = {}, []
    for text in SPECIAL_TOKENS:
        special_ids[text] = len(vocab)
        vocab[text] = len(vocab)
        added.append(
            {
                "id": special_ids[text],
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    suppressed.extend(special_ids.values())
    i = 0
    while len(vocab) < vocab_size:
        word = _filler(i)
        i += 1
        if word not in vocab:
            vocab[word] = len(vocab)
    spec["added_tokens"] = added

    config = {
        "tokenizer_class": "Qwen2Tokenizer",
        "add_prefix_space": False,
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "model_max_length": 262144,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "added_tokens_decoder": {str(a["id"]): {k: v for k, v in a.items() if k != "id"} for a in added},
        "chat_template": CHAT_TEMPLATE,
    }
    return BuiltTokenizer(
        tokenizer_json=spec,
        tokenizer_config=config,
        special_ids=special_ids,
        suppressed_ids=tuple(sorted(suppressed)),
    )
