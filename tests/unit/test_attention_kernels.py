"""The gated-attention decode kernels (`engine/kernels/attention_step.py`) and the compiled step around them
(`attention_decode`): against references in MLX operations on CUDA, and the step's plumbing on any backend with the
references standing in for the kernels."""

from collections import Counter
from dataclasses import replace

import mlx.core as mx
import mlx.nn as nn
import pytest

from engine.kernels import EXACT, FAST, KernelConfig, install, on_cuda

cuda_only = pytest.mark.cuda  # the kernels are built only on MLX's CUDA backend: skipped elsewhere (conftest)
FAST_ANYWHERE = KernelConfig(FAST, force=True)  # the fast tier off CUDA too (its quantized layers then run MLX's op)


# The gated-attention decode kernels (engine/kernels/attention_step.py) and references for them in MLX
# operations: `_keys_reference` is the layer's own path for the new k and v (its norm, rope and layout);
# `_attend_reference` is the layer's q path, then attention in float32 elementwise operations (not matmuls:
# CUDA runs float32 matmuls as TF32) and the layer's output gate.
# Both take the kernels' int parameters (n, and each row's first column and position) as arrays, as the
# kernels do, so that a compiled step replays them at every position: rope's offset is the rows' positions,
# and the attention masks each row's buffer columns outside [start, n) (their probabilities exactly 0)
# instead of slicing them off.
def _keys_reference(attn, k, v, rpar):
    b, d = k.shape[0], attn.k_norm.weight.shape[0]
    kn = attn.k_norm(k.reshape(b, 1, attn.n_kv_heads, d)).transpose(0, 2, 1, 3)
    return attn.rope(kn, offset=rpar[:, 1]), v.reshape(b, 1, attn.n_kv_heads, d).transpose(0, 2, 1, 3)


def _attend_reference(attn, q, keys, values, apar, rpar):
    b, d, h, f32 = q.shape[0], attn.q_norm.weight.shape[0], attn.n_heads, mx.float32
    n = apar[0]
    qh, gate = mx.split(q.reshape(b, 1, h, 2 * d), 2, axis=-1)
    qr = attn.rope(attn.q_norm(qh).transpose(0, 2, 1, 3), offset=rpar[:, 1]).astype(f32) * attn.scale  # [b, h, 1, d]
    group = h // attn.n_kv_heads
    k = mx.repeat(keys.astype(f32), group, axis=1)
    v = mx.repeat(values.astype(f32), group, axis=1)
    scores = mx.sum(qr * k, axis=-1)  # [b, h, cap]
    columns = mx.arange(keys.shape[2])
    held = (columns < n) & (columns >= rpar[:, :1])  # [b, cap]
    p = mx.softmax(mx.where(held[:, None, :], scores, -mx.inf), axis=-1)
    o = mx.sum(p[..., None] * v, axis=2).astype(mx.bfloat16)  # [b, h, d]
    return o.reshape(b, 1, h * d) * mx.sigmoid(gate.reshape(b, 1, h * d))


class _Attn(nn.Module):
    """The attention module's parts the kernels read, at any geometry."""

    def __init__(self, h, hkv, d, rope_dims, traditional=False, dtype=mx.bfloat16):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.scale = h, hkv, d**-0.5
        self.q_norm, self.k_norm = nn.RMSNorm(d, eps=1e-6), nn.RMSNorm(d, eps=1e-6)
        mx.random.seed(1)
        self.q_norm.weight = (1 + 0.2 * mx.random.normal((d,))).astype(dtype)
        self.k_norm.weight = (1 + 0.2 * mx.random.normal((d,))).astype(dtype)
        self.rope = nn.RoPE(rope_dims, traditional=traditional, base=1e7)


def test_attention_kernels_refuse_what_they_cannot_take():
    from engine.kernels.attention_step import refusal

    assert refusal(_Attn(24, 4, 256, 64)) is None
    assert refusal(_Attn(4, 2, 64, 16)) is None
    assert "non-traditional" in refusal(_Attn(4, 2, 64, 16, traditional=True))
    assert "head dim 48" in refusal(_Attn(4, 2, 48, 16))
    assert "head dim 512" in refusal(_Attn(4, 2, 512, 64))
    assert "multiple of kv heads" in refusal(_Attn(5, 2, 64, 16))
    assert "bf16" in refusal(_Attn(4, 2, 64, 16, dtype=mx.float32))


def test_attention_positions_split_into_chunks_that_cover_them():
    from engine.kernels.attention_step import MAX_SPLITS, SPLIT_MIN, splits

    for n in (1, 37, 64, 65, 300, 512, 513, 600, 1024, 1100, 5000, 100_000):
        s = splits(n)
        chunk = -(-n // s)  # as `attend` passes it
        assert s & (s - 1) == 0 and s <= MAX_SPLITS and (s == 1) == (n <= SPLIT_MIN)
        assert (s - 1) * chunk < n <= s * chunk  # every chunk but the last full, none empty


def test_attention_kernels_are_chosen_on_cuda_only():
    from engine.engine import Engine

    model = Engine.load("tiny-qwen35", with_tokenizer=False).model
    ks = install(model, FAST_ANYWHERE)
    install(model, KernelConfig(EXACT))
    assert ks.attention_step_layers > 0
    assert ks.attention_kernel_layers == (ks.attention_step_layers if on_cuda() else 0)


# one serial row; three rows of a left-padded batch (the continuous batcher's), prompts of three lengths (16 tokens
# or more, so that the prompts take the layers' own paths; a few tokens take the step, `window` below)
@pytest.mark.parametrize("lengths", [(20,), (17, 20, 16)])
def test_kernel_attention_step_matches_the_compiled_step(monkeypatch, lengths):
    # The step's own plumbing (the flat projections, the cache update, n and each row's positions, the output
    # into o_proj) on any backend, with the kernels replaced by the references above, against the compiled
    # step around the layer's attention (for a batch: with the batch's mask). Both decode the same forced
    # tokens. The kernel path's two compiled calls are traced once a layer: the positions are inputs, so no
    # step builds their graphs again.
    from engine.batch.runner import merge_rows
    from engine.engine import Engine
    from engine.kernels import attention_decode, attention_step

    traced = Counter()

    def keys(attn, k, v, rpar, fpar):
        traced["keys", id(attn)] += 1
        return _keys_reference(attn, k, v, rpar)

    def attend(attn, q, k, v, apar, rpar, fpar, s, grouped=False):
        traced["attend", id(attn)] += 1
        return _attend_reference(attn, q, k, v, apar, rpar)

    monkeypatch.setattr(attention_step, "keys", keys)
    monkeypatch.setattr(attention_step, "attend", attend)
    model = Engine.load("tiny-qwen35", with_tokenizer=False).model  # bf16

    def decode(kernels: bool):
        monkeypatch.setattr(attention_decode, "kernel_applies", lambda layer: kernels)
        ks = install(model, FAST_ANYWHERE)
        singles = [model.make_cache() for _ in lengths]
        for n, single in zip(lengths, singles):
            model(mx.array([list(range(3, 3 + n))]), single)
        cache = singles[0] if len(lengths) == 1 else merge_rows(singles)
        rows = len(lengths)
        logits = [model(mx.array([[t + r for r in range(rows)]]).T, cache)[:, -1] for t in range(20, 32)]
        mx.eval(logits, [c.state for c in cache])
        install(model, KernelConfig(EXACT))
        return ks, logits, cache

    _, compiled, compiled_cache = decode(False)
    ks, kernel, kernel_cache = decode(True)
    assert ks.attention_kernel_layers == ks.attention_step_layers > 0
    # once for each attention layer that ran, over 12 steps (the MTP head's layer does not run here)
    assert traced and set(traced.values()) == {1} and len(traced) % 2 == 0
    # Each attention layer's cache is the layer's own k and v (the same operations) where its inputs agree:
    # in the first attention layer (the layers before it run the same operations in both).
    first = next(i for i, layer in enumerate(model.layers) if not layer.is_linear)
    for a, b in zip(compiled_cache[first].state, kernel_cache[first].state):
        assert mx.array_equal(a, b).item()
    # MLX's attention rounds q * scale, the scores and the probabilities to bf16, the reference does not:
    # the logits differ by a few bf16 ulps (2^-8 relative each) of their largest magnitude.
    worst = max((mx.abs(a - b).max() / mx.abs(a).max()).item() for a, b in zip(compiled, kernel))
    assert worst < 2**-5


def test_attention_takes_a_block_per_kv_head_from_the_group_rows(monkeypatch):
    # KernelConfig.attention_group_rows: a decode step of that many rows or more asks `attend` for the grouped
    # blocks, fewer rows for a block per q head (off CUDA the reference stands in for the kernels).
    from engine.batch.runner import merge_rows
    from engine.engine import Engine
    from engine.kernels import attention_decode, attention_step

    asked = []

    def attend(attn, q, k, v, apar, rpar, fpar, s, grouped=False):
        asked.append((q.shape[0], grouped))
        return _attend_reference(attn, q, k, v, apar, rpar)

    monkeypatch.setattr(attention_step, "keys", lambda attn, k, v, rpar, fpar: _keys_reference(attn, k, v, rpar))
    monkeypatch.setattr(attention_step, "attend", attend)
    monkeypatch.setattr(attention_decode, "kernel_applies", lambda layer: True)
    model = Engine.load("tiny-qwen35", with_tokenizer=False).model
    install(model, replace(FAST_ANYWHERE, attention_group_rows=3))
    for rows in (1, 3):
        singles = [model.make_cache() for _ in range(rows)]
        for single in singles:
            model(mx.array([list(range(3, 20))]), single)
        cache = singles[0] if rows == 1 else merge_rows(singles)
        mx.eval(model(mx.array([[7] * rows]).T, cache))
    install(model, KernelConfig(EXACT))
    assert asked and set(asked) == {(1, False), (3, True)}


# one serial row; three rows of a left-padded batch
@pytest.mark.parametrize("lengths", [(20,), (17, 20, 16)])
def test_a_window_decodes_as_its_tokens_one_at_a_time(monkeypatch, lengths):
    # A verify window of 4 tokens on the fast tier with the kernels (off CUDA: the references above stand in
    # for them): each token's k, v and attention as a decode step's, the DeltaNet core token after token, the
    # projections and the MLP over all its rows. Its logits at every position, its caches and its recorded
    # states equal those of the same tokens decoded one step at a time, bit for bit (on CUDA from two rows: the
    # quantized matmul's sums do not depend on the rows a launch takes from 2 to 64): a speculative window
    # verifies what plain decoding would emit.
    from engine.batch.runner import merge_rows
    from engine.engine import Engine
    from engine.kernels import attention_decode, attention_step

    if not on_cuda():
        monkeypatch.setattr(attention_step, "keys", lambda attn, k, v, rpar, fpar: _keys_reference(attn, k, v, rpar))
        monkeypatch.setattr(
            attention_step,
            "attend",
            lambda attn, q, k, v, apar, rpar, fpar, s, grouped=False: _attend_reference(attn, q, k, v, apar, rpar),
        )
    monkeypatch.setattr(attention_decode, "kernel_applies", lambda layer: True)
    model = Engine.load("tiny-qwen35", with_tokenizer=False).model  # bf16
    ks = install(model, FAST_ANYWHERE)
    assert ks.attention_kernel_layers == ks.attention_step_layers > 0
    rows, tokens = len(lengths), [[40 + 3 * t + r for t in range(4)] for r in range(len(lengths))]

    def prefilled():
        singles = [model.make_cache() for _ in lengths]
        for n, single in zip(lengths, singles):
            model(mx.array([list(range(3, 3 + n))]), single)
        return singles[0] if rows == 1 else merge_rows(singles)

    window_cache = prefilled()
    for c in window_cache:
        if hasattr(c, "start_trace"):
            c.start_trace()
    window = model(mx.array(tokens), window_cache)
    steps_cache = prefilled()
    steps = mx.concatenate([model(mx.array([[row[t]] for row in tokens]), steps_cache) for t in range(4)], axis=1)
    mx.eval(window, steps)
    if on_cuda() and rows == 1:  # one row decodes on the register kernel, a window's rows on the staged one
        assert (mx.abs(window - steps).max() / mx.abs(steps).max()).item() < 2**-5
        return
    assert mx.array_equal(window, steps).item()
    for a, b in zip(window_cache, steps_cache):
        if hasattr(a, "start_trace"):
            assert mx.array_equal(a.trace.states[-1], b[1]).item() and mx.array_equal(a[0], b[0]).item()
        else:
            assert all(mx.array_equal(x, y).item() for x, y in zip(a.state, b.state))
    install(model, KernelConfig(EXACT))


@cuda_only
# one launch (n = 1, 300, 37), positions in 16 chunks (1100; 600 with two batch rows and the last chunk short);
# rows of a left-padded batch, each from its own first column (up to 64 rows, starts past a whole chunk)
@pytest.mark.parametrize(
    "h, hkv, d, rope_dims, b, n",
    [
        (24, 4, 256, 64, 1, 1),
        (24, 4, 256, 64, 1, 300),
        (24, 4, 256, 64, 1, 1100),
        (4, 2, 64, 16, 2, 37),
        (4, 2, 64, 16, 2, 600),
        (24, 4, 256, 64, 9, 200),
        (24, 4, 256, 64, 33, 700),
        (4, 2, 64, 16, 64, 130),
    ],
)
@pytest.mark.parametrize("grouped", [False, True])
def test_attention_kernels_match_the_references(h, hkv, d, rope_dims, b, n, grouped):
    from engine.kernels.attention_step import attend, attend_params, float_params, keys, row_params

    attn, bf = _Attn(h, hkv, d, rope_dims), mx.bfloat16
    mx.random.seed(2)
    q = mx.random.normal((b, 1, h * 2 * d)).astype(bf)
    k, v = mx.random.normal((b, 1, hkv * d)).astype(bf), mx.random.normal((b, 1, hkv * d)).astype(bf)
    cap = (n + 255) // 256 * 256
    keys_buf = mx.random.normal((b, hkv, cap, d)).astype(bf)
    values_buf = mx.random.normal((b, hkv, cap, d)).astype(bf)
    fpar = float_params(attn)
    starts = tuple((r * 97) % n if b > 2 else 0 for r in range(b))  # a batch of rows: starts up to n - 1
    rpar = row_params(starts, tuple(n - 1 - start for start in starts))
    got_k, got_v = keys(attn, k, v, rpar, fpar)
    want_k, want_v = _keys_reference(attn, k, v, rpar)
    assert mx.array_equal(got_v, want_v).item()
    # The same roundings as the layer (the norm, then rope, to bf16); the sum of squares in another order can
    # move the normed channel (and so the rope's pair) by one bf16 ulp.
    assert (mx.abs(got_k.astype(mx.float32) - want_k) <= 2**-7 * mx.abs(want_k).max()).all().item()
    keys_buf[:, :, n - 1 : n] = want_k
    values_buf[:, :, n - 1 : n] = want_v
    apar, s = attend_params(n, cap)
    got = attend(attn, q, keys_buf, values_buf, apar, rpar, fpar, s, grouped).astype(mx.float32)
    want = _attend_reference(attn, q, keys_buf, values_buf, apar, rpar).astype(mx.float32)
    if grouped:  # a block per kv head: each q head's sums as a block per q head runs them, bit for bit
        assert mx.array_equal(got, attend(attn, q, keys_buf, values_buf, apar, rpar, fpar, s).astype(mx.float32)).item()
    # Both round the attention output and the gated output to bf16 from float32 values that differ only by
    # summation order and __expf: a rounding that falls the other way is one bf16 ulp, up to 2^-7 of the
    # value, at each of the two.
    err = mx.abs(got - want) / (mx.abs(want) + 2**-6 * mx.abs(want).max())
    print(f"largest error / |value|: {err.max().item():.3g} (bound 2^-6 = {2**-6:.3g})")
    assert (err <= 2**-6).all().item()
