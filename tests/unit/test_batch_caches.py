"""Batched caches against mlx-lm's, model-free: the same operations must give the
same contents, offsets and masks (the same-B oracle runs mlx-lm's caches)."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models import cache as ref

from engine.cache import BatchKVCache, BatchRotatingKVCache, KVCache, RecurrentCache, RotatingKVCache

H, D = 2, 4
_counter = [0]


def _kv(b, n):
    _counter[0] += 1
    k = mx.random.normal((b, H, n, D), key=mx.random.key(_counter[0]))
    return k, -k


def _same(a, b):
    return np.array_equal(np.array(a), np.array(b))


def _prefill_solo(cls_ours, cls_ref, n, **kw):
    ours, theirs = cls_ours(**kw), cls_ref(**kw)
    for chunk in (n // 2, n - n // 2):
        if chunk:
            k, v = _kv(1, chunk)
            ours.update_and_fetch(k, v)
            theirs.update_and_fetch(k, v)
    return ours, theirs


def test_kv_merge_extend_decode_filter_extract_match_mlx_lm():
    solos = [_prefill_solo(KVCache, ref.KVCache, n) for n in (5, 300, 1)]
    ours = BatchKVCache.merge([o for o, _ in solos[:2]])
    theirs = ref.BatchKVCache.merge([t for _, t in solos[:2]])
    for step in range(3):
        k, v = _kv(2, 1)
        assert _same(ours.offset, theirs.offset)
        assert _same(ours.make_mask(1), theirs.make_mask(1))
        for a, b in zip(ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)):
            assert _same(a, b)
    joiner_o, joiner_t = BatchKVCache.merge([solos[2][0]]), ref.BatchKVCache.merge([solos[2][1]])
    ours.extend(joiner_o)
    theirs.extend(joiner_t)
    k, v = _kv(3, 1)
    assert _same(ours.offset, theirs.offset) and _same(ours.make_mask(1), theirs.make_mask(1))
    for a, b in zip(ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)):
        assert _same(a, b)
    ours.filter([0, 2])  # the long row retires: shared padding is trimmed
    theirs.filter([0, 2])
    assert ours.idx == theirs._idx and ours.left_padding == theirs.left_padding.tolist()
    for a, b in zip(ours.fetch(), theirs.keys_and_values()):
        assert _same(a, b)
    for row in (0, 1):
        e, t = ours.extract(row), theirs.extract(row)
        assert e.offset == t.offset and _same(e.keys, t.keys) and _same(e.values, t.values)


def test_extend_into_an_empty_batch():
    ours, theirs = BatchKVCache([]), ref.BatchKVCache([])
    solo_o, solo_t = _prefill_solo(KVCache, ref.KVCache, 9)
    ours.extend(BatchKVCache.merge([solo_o]))
    theirs.extend(ref.BatchKVCache.merge([solo_t]))
    assert ours.idx == theirs._idx and _same(ours.fetch()[0], theirs.keys_and_values()[0])


@pytest.mark.parametrize("lengths", [(5, 40), (70, 3), (130, 20)])
def test_rotating_batch_matches_mlx_lm_across_the_wrap(lengths):
    window = 32
    # joiners prefill as one-row batches made from empty caches, as the scheduler does
    rows = []
    for n in lengths:
        o = BatchRotatingKVCache.merge([RotatingKVCache(max_size=window)])
        t = ref.BatchRotatingKVCache.merge([ref.RotatingKVCache(max_size=window)])
        k, v = _kv(1, n - 1)
        o.update_and_fetch(k, v)
        t.update_and_fetch(k, v)
        k, v = _kv(1, 1)  # the tail token, L=1
        o.update_and_fetch(k, v)
        t.update_and_fetch(k, v)
        rows.append((o, t))
    ours, theirs = rows[0]
    ours.extend(rows[1][0])
    theirs.extend(rows[1][1])
    for step in range(45):  # past another wrap
        assert _same(ours.offset, theirs.offset), step
        assert ours.left_padding == theirs.left_padding.tolist(), step
        assert _same(ours.make_mask(1, window_size=window), theirs.make_mask(1, window_size=window)), step
        k, v = _kv(2, 1)
        for a, b in zip(ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)):
            assert _same(a, b), step
        if step == 20:
            ours.filter([1, 0])
            theirs.filter([1, 0])
    for row in (0, 1):
        e, t = ours.extract(row), theirs.extract(row)
        assert e.offset == t.offset and _same(e.keys, t.keys)


def test_rotating_merge_of_solo_caches_matches_mlx_lm():
    solos = [_prefill_solo(RotatingKVCache, ref.RotatingKVCache, n, max_size=16) for n in (40, 9)]
    for o, t in solos:  # a decode step each so the solo rings rotate
        k, v = _kv(1, 1)
        o.update_and_fetch(k, v)
        t.update_and_fetch(k, v)
    ours = BatchRotatingKVCache.merge([o for o, _ in solos])
    theirs = ref.BatchRotatingKVCache.merge([t for _, t in solos])
    assert _same(ours.keys, theirs.keys) and ours.left_padding == theirs.left_padding.tolist()
    assert _same(ours.make_mask(1), theirs.make_mask(1))


def test_recurrent_batch_ops_match_mlx_lm():
    def solo(cls, seed):
        c = cls(2)
        c[0] = mx.random.normal((1, 3, 8), key=mx.random.key(seed))
        c[1] = mx.random.normal((1, 2, 4, 4), key=mx.random.key(seed + 1))
        return c

    ours = RecurrentCache.merge([RecurrentCache(2)])
    theirs = ref.ArraysCache.merge([ref.ArraysCache(2)])
    assert ours.left_padding == theirs.left_padding.tolist()
    ours.slots, theirs.cache = solo(RecurrentCache, 1).slots, solo(ref.ArraysCache, 1).cache
    ours.extend(RecurrentCache.merge([solo(RecurrentCache, 5)]))
    theirs.extend(ref.ArraysCache.merge([solo(ref.ArraysCache, 5)]))
    for a, b in zip(ours.slots, theirs.cache):
        assert _same(a, b)
    ours.filter([1])
    theirs.filter([1])
    assert _same(ours.extract(0)[1], theirs.extract(0)[1])


def test_unpadded_batch_keeps_mlx_lm_masks_and_offset_arrays():
    # mlx-lm's batched graph even with no padding: CUDA's unmasked kernel rounds differently
    ours, theirs = BatchKVCache([0, 0]), ref.BatchKVCache([0, 0])
    k, v = _kv(2, 4)
    ours.update_and_fetch(k, v)
    theirs.update_and_fetch(k, v)
    for n in (1, 3):
        assert _same(ours.make_mask(n), theirs.make_mask(n))
    assert _same(ours.offset, theirs.offset)


def _padded_prefill(ours, theirs, lengths):
    """One right-padded chunk for several rows, then finalize (mlx-lm's prompt batch)."""
    longest = max(lengths)
    padding = [longest - n for n in lengths]
    ours.prepare(lengths=lengths, right_padding=padding)
    theirs.prepare(lengths=lengths, right_padding=padding)
    k, v = _kv(len(lengths), longest)
    ours.update_and_fetch(k, v)
    theirs.update_and_fetch(k, v)
    ours.finalize()
    theirs.finalize()


@pytest.mark.parametrize("lengths", [(5, 40, 17), (3, 3), (64, 10, 90)])
def test_padded_group_prefill_matches_mlx_lm(lengths):
    ours = BatchKVCache.merge([KVCache() for _ in lengths])
    theirs = ref.BatchKVCache.merge([ref.KVCache() for _ in lengths])
    _padded_prefill(ours, theirs, list(lengths))
    assert ours.left_padding == theirs.left_padding.tolist() and _same(ours.offset, theirs.offset)
    for a, b in zip(ours.fetch(), theirs.keys_and_values()):
        assert _same(a, b)
    k, v = _kv(len(lengths), 1)
    assert _same(ours.make_mask(1), theirs.make_mask(1))
    for a, b in zip(ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)):
        assert _same(a, b)


@pytest.mark.parametrize("lengths", [(5, 40, 17), (70, 9), (100, 130)])
def test_padded_group_prefill_of_rotating_caches_matches_mlx_lm(lengths):
    window = 32
    ours = BatchRotatingKVCache.merge([RotatingKVCache(max_size=window) for _ in lengths])
    theirs = ref.BatchRotatingKVCache.merge([ref.RotatingKVCache(max_size=window) for _ in lengths])
    _padded_prefill(ours, theirs, list(lengths))
    for step in range(40):
        assert ours.left_padding == theirs.left_padding.tolist(), step
        assert _same(ours.offset, theirs.offset) and _same(ours.make_mask(1), theirs.make_mask(1)), step
        k, v = _kv(len(lengths), 1)
        for a, b in zip(ours.update_and_fetch(k, v), theirs.update_and_fetch(k, v)):
            assert _same(a, b), step


def test_recurrent_prepare_masks_past_each_length_and_finalize_clears():
    ours, theirs = RecurrentCache.merge([RecurrentCache(2)] * 2), ref.ArraysCache.merge([ref.ArraysCache(2)] * 2)
    ours.prepare(lengths=[3, 5], right_padding=[2, 0])
    theirs.prepare(lengths=[3, 5], right_padding=[2, 0])
    assert _same(ours.make_mask(5), theirs.make_mask(5))
    ours.advance(5)
    theirs.advance(5)
    ours.finalize()
    theirs.finalize()
    assert ours.lengths is None and ours.left_padding is None and theirs.lengths is None


def _serial_kv(chunks):
    """A serial cache fed these (keys, values) chunks of one row."""
    c = KVCache()
    for k, v in chunks:
        c.update_and_fetch(k, v)
    return c


@pytest.mark.parametrize("drops", [[0, 3, 1], [2, 2, 2], [3, 0, 0]])
def test_trim_rows_leaves_each_row_as_a_serial_cache_fed_only_its_kept_tokens(drops):
    lengths, width = (5, 9, 1), 4
    rows = [[_kv(1, n)] for n in lengths]
    batch = BatchKVCache.merge([_serial_kv(r) for r in rows])
    k, v = _kv(3, width)  # a verify window: each row keeps width - drops[b] of it
    batch.update_and_fetch(k, v)
    before = list(batch.left_padding)
    batch.trim_rows(drops)
    assert batch.offsets == [n + width - d for n, d in zip(lengths, drops)]
    if len(set(drops)) == 1:  # nothing rolls: the padding stays, only the write index moves back
        assert batch.left_padding == before
    k2, v2 = _kv(3, 2)  # the next window writes after each row's kept tokens
    batch.update_and_fetch(k2, v2)
    for b, d in enumerate(drops):
        kept = width - d
        rows[b] += [(k[b : b + 1, :, :kept], v[b : b + 1, :, :kept]), (k2[b : b + 1], v2[b : b + 1])]
        serial, row = _serial_kv(rows[b]), batch.extract(b)
        assert row.offset == serial.offset == batch.offsets[b]
        assert _same(row.keys, serial.keys[..., : serial.offset, :])
        assert _same(row.values, serial.values[..., : serial.offset, :])


def test_trim_rows_refuses_more_than_a_row_holds():
    batch = BatchKVCache.merge([_serial_kv([_kv(1, 2)]), _serial_kv([_kv(1, 4)])])
    with pytest.raises(ValueError):
        batch.trim_rows([3, 0])
    with pytest.raises(ValueError):
        batch.trim_rows([1])


def _traced(b, width, n, seed):
    """A recurrent cache of b rows right after a traced forward of n tokens: conv inputs and a state per token."""
    key = mx.random.key(seed)
    cache = RecurrentCache()
    cache.start_trace()
    cache.trace.conv_input = mx.random.normal((b, width + n, 6), key=key)
    cache.trace.states = [mx.random.normal((b, 2, 3, 3), key=mx.random.key(seed + 1 + t)) for t in range(n)]
    cache.slots = [cache.trace.conv_input[:, -width:], cache.trace.states[-1]]
    return cache


def test_keep_traced_rows_keeps_each_rows_own_point():
    kept, width, n = [1, 4, 2], 3, 4
    batch = _traced(3, width, n, seed=7)
    trace = batch.trace
    batch.keep_traced_rows(kept)
    assert batch.trace is None
    for b, k in enumerate(kept):
        serial = RecurrentCache()
        serial.trace = type(trace)(trace.conv_input[b : b + 1], [s[b : b + 1] for s in trace.states])
        serial.offset = n
        serial.keep_traced(k)
        row = batch.extract(b)
        assert all(_same(a, s) for a, s in zip(row.slots, serial.slots))
    with pytest.raises(ValueError):
        _traced(2, width, n, seed=9).keep_traced_rows([0, 1])
