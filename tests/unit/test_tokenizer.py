import json
import unicodedata

import pytest
from tokenizers import Tokenizer as RawTokenizer

from engine.registry import base_names, get_spec
from engine.synth.tokenizer import SPECIAL_TOKENS, corpus_text
from engine.tokenizer import Tokenizer

SAMPLES = [
    "The quick brown fox jumps over the lazy dog.",
    "e\u0301cole cafe\u0301 x\u0327 — combining marks",  # \p{M}: qwen3_5 splits these differently
    "中文测试 and 日本語 mixed with emoji 🚀✅",
    "  leading spaces\n\n\ttabs and\r\nnewlines  ",
    "numbers 1234567 3.14159 0x7FFF",
    "<|im_start|>user\nhi<|im_end|>",
]


@pytest.mark.parametrize("base", base_names("tiny"))
def test_engine_mlx_lm_and_raw_tokenizers_agree(base, tiny_path):
    import mlx_lm.utils

    path = tiny_path(base)
    ours = Tokenizer(path)
    theirs = mlx_lm.utils.load_tokenizer(path)
    raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
    text = corpus_text()
    for s in SAMPLES + [text[:4000], text[-2000:]]:
        ids = ours.encode(s)
        assert ids == theirs.encode(s), s[:40]
        assert ids == raw.encode(s).ids, s[:40]


@pytest.mark.parametrize("base", ["tiny-qwen35", "tiny-llama"])
def test_vocabulary_is_exact_and_every_id_decodes(base, tiny_path):
    path = tiny_path(base)
    vocab = get_spec(base).geometry.vocab_size
    raw = RawTokenizer.from_file(str(path / "tokenizer.json"))
    assert raw.get_vocab_size() == vocab
    assert Tokenizer(path).vocab_size == vocab
    for i in range(vocab):
        assert raw.id_to_token(i) is not None
    decoded = raw.decode_batch([[i] for i in range(vocab)], skip_special_tokens=False)
    assert all(isinstance(d, str) and d != "" for d in decoded)


def test_corpus_text_round_trips(tiny_path):
    tok = Tokenizer(tiny_path("tiny-qwen3"))
    text = corpus_text()
    for start in range(0, len(text), 5000):
        chunk = text[start : start + 5000]
        assert tok.decode(tok.encode(chunk)) == unicodedata.normalize("NFC", chunk)


def test_special_tokens_and_chat_template(tiny_path):
    path = tiny_path("tiny-qwen35")
    tok = Tokenizer(path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    specials = {v["content"] for v in config["added_tokens_decoder"].values()}
    assert specials == set(SPECIAL_TOKENS)
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert tok.decode(ids) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    gen = json.loads((path / "generation_config.json").read_text())
    assert set(gen["eos_token_id"]) <= tok.eos_ids | set(gen["eos_token_id"])
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok._hf.convert_tokens_to_ids("<|im_end|>")]


def test_the_chat_template_renders_tools_calls_and_thinking_off(tiny_path):
    # Qwen3's format: tools as a system turn asking for <tool_call> blocks, earlier calls and tool answers in the
    # history, an empty think block when thinking is off; without them the plain turns above
    tok = Tokenizer(tiny_path("tiny-qwen3"))
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    history = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}],
        },
        {"role": "tool", "content": "4 C"},
    ]
    text = tok.decode(tok.apply_chat_template(history, tools=[tool], template_kwargs={"enable_thinking": False}))
    assert text.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' in text
    assert "<tool_response>\n4 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
