import mlx.core as mx
import numpy as np

from engine.cache import KVCache, QuantizedKVCache, RecurrentCache, RotatingKVCache


def _kv(n, offset=0, heads=2, dim=8):
    base = mx.arange(offset, offset + n, dtype=mx.float32)[None, None, :, None]
    return mx.broadcast_to(base, (1, heads, n, dim)), mx.broadcast_to(-base, (1, heads, n, dim))


def test_kv_cache_grows_in_256_steps_and_trims():
    c = KVCache()
    k, v = c.update_and_fetch(*_kv(3))
    assert k.shape[2] == 3 and c.keys.shape[2] == 256 and c.offset == 3
    for i in range(3, 300):
        c.update_and_fetch(*_kv(1, i))
    assert c.offset == 300 and c.keys.shape[2] == 512
    assert c.trim(10) == 10 and c.offset == 290
    assert c.fetch()[0][0, 0, :, 0].tolist() == list(range(290))
    assert c.nbytes == 2 * 1 * 2 * 512 * 8 * 4 and c.is_trimmable()


def test_rotating_cache_keeps_the_window_across_the_wrap():
    window = 16
    c = RotatingKVCache(max_size=window)
    c.update_and_fetch(*_kv(20))  # prefill longer than the window
    for i in range(20, 60):
        k, _ = c.update_and_fetch(*_kv(1, i))
        held = sorted(k[0, 0, :, 0].tolist())
        assert held == list(range(i - window + 1, i + 1)), f"step {i}"
    assert c.offset == 60 and c.size() == window and not c.is_trimmable()


def test_rotating_cache_trims_before_it_fills():
    c = RotatingKVCache(max_size=16)
    c.update_and_fetch(*_kv(5))
    assert c.is_trimmable() and c.trim(2) == 2 and c.offset == 3


def test_quantized_cache_round_trips_within_quantization_error():
    c = QuantizedKVCache(group_size=32, bits=8)
    keys = mx.random.normal((1, 2, 10, 64), key=mx.random.key(0))
    (qk, sk, bk), _ = c.update_and_fetch(keys, keys)
    back = mx.dequantize(qk, sk, bk, group_size=32, bits=8)
    assert float(mx.abs(back - keys).max()) < 0.05
    assert c.offset == 10 and c.trim(4) == 4 and c.offset == 6
    assert c.nbytes > 0 and len(c.state) == 6


def test_quantized_from_kv_keeps_offset():
    kv = KVCache()
    kv.update_and_fetch(*_kv(5, dim=32))
    q = QuantizedKVCache.from_kv(kv, group_size=32, bits=4)
    assert q.offset == 5 and q.fetch()[0][0].shape[2] == 5


def test_recurrent_cache_cannot_trim_but_restores_snapshots():
    c = RecurrentCache()
    c[0], c[1] = mx.zeros((1, 3, 4)), mx.ones((1, 2, 4, 4))
    c.advance(7)
    snap, offset = c.snapshot(), c.offset
    c[1] = mx.zeros((1, 2, 4, 4))
    c.advance(1)
    assert not c.is_trimmable() and c.trim(3) == 0
    c.restore(snap, offset)
    assert c.offset == 7 and mx.array_equal(c[1], mx.ones((1, 2, 4, 4))).item()
    assert c.nbytes == (3 * 4 + 2 * 16) * 4 and c.make_mask(3) is None


def test_recurrent_mask_marks_left_padding():
    c = RecurrentCache()
    c.left_padding = [2, 0]
    assert np.array(c.make_mask(3)).tolist() == [[False, False, True], [True, True, True]]
