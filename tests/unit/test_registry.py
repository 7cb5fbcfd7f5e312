import pytest

from engine.errors import UnknownModelError
from engine.registry import all_specs, base_names, get_spec


def test_default_variants():
    assert get_spec("tiny-qwen35").dtype == "bfloat16"
    assert get_spec("tiny-qwen35").quantization is None
    q = get_spec("qwen27b").quantization
    assert (q.bits, q.group_size, q.mode) == (4, 64, "affine")


def test_variant_suffixes_resolve_to_canonical_names():
    assert get_spec("tiny-llama-bf16").name == "tiny-llama"  # bf16 is the tiny default
    assert get_spec("tiny-llama-f32").dtype == "float32"
    s = get_spec("tiny-gemma3-4bit-g32")
    assert (s.quantization.bits, s.quantization.group_size) == (4, 32)
    assert get_spec("qwen27b-4bit").name == "qwen27b"


@pytest.mark.parametrize("name", ["nope", "tiny-llama-3bit", "qwen27b-f32", ""])
def test_unknown_names_explain_what_exists(name):
    with pytest.raises(UnknownModelError) as e:
        get_spec(name)
    assert "tiny" in str(e.value) or "variant" in str(e.value)


def test_qwen27b_true_geometry():
    g = get_spec("qwen27b").geometry
    assert (g.num_hidden_layers, g.hidden_size, g.intermediate_size) == (64, 5120, 17408)
    assert (g.num_attention_heads, g.num_key_value_heads, g.head_dim) == (24, 4, 256)
    assert (g.linear_num_key_heads, g.linear_num_value_heads, g.linear_key_head_dim) == (16, 48, 128)
    assert (g.linear_conv_kernel_dim, g.vocab_size, g.tie_word_embeddings) == (4, 248_320, False)
    kinds = g.layer_kinds()
    assert kinds.count("attention") == 16 and all(kinds[i] == "attention" for i in range(3, 64, 4))


def test_every_tiny_family_has_the_parity_variants():
    assert set(base_names("tiny")) >= {"tiny-llama", "tiny-qwen3", "tiny-qwen35", "tiny-gemma3"}
    names = {s.name for s in all_specs(("tiny",))}
    for base in base_names("tiny"):
        assert {base, f"{base}-f32", f"{base}-4bit"} <= names


def test_gemma_layer_kinds_alternate_sliding_and_global():
    assert get_spec("tiny-gemma3").geometry.layer_kinds() == ["sliding", "attention"] * 2
