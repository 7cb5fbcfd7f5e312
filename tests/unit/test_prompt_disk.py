"""The prompt cache's disk tier: what RAM evicts or flushes comes back after a restart, exact; bad files never do."""

import errno
import json
import threading

import mlx.core as mx
import pytest

from engine.cache.prompt_cache import PromptCache, snapshot
from engine.cache.prompt_disk import DiskTier, artifact_key, prefix_key
from engine.generate import BlockSnapshots, KVQuantization, generate
from engine.loading import load_model
from engine.request import CachedPrefix, StopCriteria

STOP = StopCriteria(max_tokens=3, ignore_eos=True)
SYSTEM = tuple(3 + (i * 37) % 200 for i in range(300))


MODELS = {"dense": "tiny-qwen3-f32", "hybrid": "tiny-qwen35-f32"}


@pytest.fixture(scope="module")
def models(tiny_path):
    return {kind: load_model(tiny_path(name))[0] for kind, name in MODELS.items()}


@pytest.fixture
def dense(models):
    return models["dense"]


def served(model, prompt):
    """A finished request's entry: its caches (prompt and fed tokens) and block snapshots every 128 tokens."""
    cache, fed, snaps = model.make_cache(), [], []
    list(
        generate(
            model,
            prompt,
            stop=STOP,
            cache=cache,
            fed=fed,
            blocks=BlockSnapshots(128, lambda n, c: snaps.append((n, snapshot(c)))),
        )
    )
    return CachedPrefix(tuple(prompt) + tuple(fed), cache, tuple(snaps))


def logits(model, prompt, cache=None, cached=0):
    out = []
    list(generate(model, prompt, stop=STOP, cache=cache, cached_tokens=cached, tap=lambda s: out.append(s.logits)))
    return out


@pytest.mark.parametrize("which, start", [("dense", 300), ("hybrid", 256)])
def test_an_entry_evicted_to_disk_serves_after_a_restart_bit_for_bit(which, start, tmp_path, models):
    model = models[which]
    entry = served(model, SYSTEM + (7, 8))
    ram = PromptCache(1, DiskTier(tmp_path, "a", 1 << 30))  # too small to keep it: straight to disk
    assert not ram.insert(entry) and len(ram.disk.entries) == 0  # larger than RAM: not stored at all
    ram = PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30))
    ram.insert(entry)
    ram.max_bytes = ram.bytes
    ram.insert(served(model, (5, 6, 7)))  # evicts the first to disk
    assert len(ram) == 1 and len(ram.disk.entries) == 1

    restarted = PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30))
    other = SYSTEM + (11, 12)
    hit = restarted.lookup(other)
    assert len(hit.tokens) == start and restarted.stats().disk_hits == 1
    for cold, warm in zip(logits(model, other), logits(model, other, hit.cache, start)):
        assert mx.array_equal(cold, warm).item()
    assert len(restarted.lookup(other).tokens) == start and restarted.stats().disk_hits == 1  # now in RAM


@pytest.mark.parametrize("which", ["dense", "hybrid"])
def test_a_quantized_kv_entry_serves_after_a_restart_bit_for_bit(which, tmp_path, models):
    model, kv = models[which], KVQuantization(bits=8, group_size=32, start=0)
    cache, fed = model.make_cache(), []
    list(generate(model, SYSTEM + (7, 8), stop=STOP, cache=cache, fed=fed, kv_quantization=kv, prefill_step_size=64))
    stored = SYSTEM + (7, 8) + tuple(fed)
    pc = PromptCache(1 << 30, DiskTier(tmp_path, "q", 1 << 30), full_chunk=64)
    assert pc.insert(CachedPrefix(stored, cache, full_chunk=64)) and pc.flush() == 1

    restarted = PromptCache(1 << 30, DiskTier(tmp_path, "q", 1 << 30), full_chunk=64)
    other = stored + (11, 12)  # the next turn
    hit = restarted.lookup(other)
    assert hit.tokens == stored and hit.full_chunk == 64 and restarted.stats().disk_hits == 1

    def run(cache=None, cached=0):
        out = []
        list(
            generate(
                model,
                other,
                stop=STOP,
                cache=cache,
                cached_tokens=cached,
                kv_quantization=kv,
                prefill_step_size=64,
                tap=lambda s: out.append(s.logits),
            )
        )
        return out

    for cold, warm in zip(run(), run(hit.cache, len(stored))):
        assert mx.array_equal(cold, warm).item()


def test_shutdown_flushes_ram_to_disk_and_other_artifacts_see_nothing(dense, tmp_path):
    pc = PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30))
    pc.insert(served(dense, SYSTEM))
    assert pc.flush() == 1
    assert PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30)).lookup(SYSTEM + (1,)) is not None
    assert PromptCache(1 << 30, DiskTier(tmp_path, "b", 1 << 30)).lookup(SYSTEM + (1,)) is None


def test_artifact_keys_differ_by_model_and_scheme(tiny_path):
    a, b = tiny_path("tiny-qwen3-f32"), tiny_path("tiny-qwen35-f32")
    assert artifact_key(a, "tier exact") == artifact_key(a, "tier exact")
    assert len({artifact_key(a, "tier exact"), artifact_key(a, "tier fast"), artifact_key(b, "tier exact")}) == 3


@pytest.mark.parametrize("damage", ["flip", "truncate", "manifest", "foreign"])
def test_a_damaged_entry_is_removed_never_served(dense, tmp_path, damage):
    pc = PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30))
    pc.insert(served(dense, SYSTEM))
    pc.flush()
    key = prefix_key(tuple(pc._entries)[0])
    data, manifest = tmp_path / "a" / f"{key}.safetensors", tmp_path / "a" / f"{key}.json"
    raw = bytearray(data.read_bytes())
    if damage == "flip":
        raw[-5] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif damage == "truncate":
        data.write_bytes(bytes(raw[: len(raw) // 2]))
    elif damage == "manifest":
        manifest.write_text(manifest.read_text()[:40])
    else:
        m = json.loads(manifest.read_text())
        m["format"] = 0
        manifest.write_text(json.dumps(m))
    restarted = PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30))
    assert restarted.lookup(SYSTEM + (1,)) is None
    assert not data.exists() and not manifest.exists() and len(restarted.disk.entries) == 0


def test_the_disk_budget_drops_the_oldest(dense, tmp_path):
    one = served(dense, SYSTEM)
    pc = PromptCache(1 << 30, DiskTier(tmp_path, "a", 1 << 30))
    pc.insert(one)
    pc.flush()
    size = pc.disk.bytes
    small = PromptCache(1 << 30, DiskTier(tmp_path, "a", int(1.5 * size)))
    small.insert(served(dense, (9,) + SYSTEM))
    small.flush()
    assert len(small.disk.entries) == 1 and small.disk.dropped == 1
    assert small.disk.bytes <= 1.5 * size


def test_an_unwritable_directory_or_a_full_disk_leaves_the_cache_in_ram(dense, tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    off = PromptCache(1 << 30, DiskTier(blocker, "a", 1 << 30))
    assert not off.disk.on and off.stats().disk_error
    assert off.insert(served(dense, SYSTEM)) and off.flush() == 0 and off.lookup(SYSTEM + (1,)) is not None

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    pc = PromptCache(1 << 30, DiskTier(tmp_path / "d", "a", 1 << 30))
    monkeypatch.setattr(mx, "save_safetensors", full)
    pc.insert(served(dense, SYSTEM))
    assert pc.flush() == 0 and "No space" in pc.stats().disk_error
    assert pc.lookup(SYSTEM + (1,)) is not None  # RAM goes on
    assert list((tmp_path / "d" / "a").iterdir()) == []  # no partial file left


def test_concurrent_writers_of_one_directory_leave_whole_entries(dense, tmp_path):
    entries = [served(dense, SYSTEM), served(dense, (9,) + SYSTEM)]
    tiers = [DiskTier(tmp_path, "a", 1 << 30) for _ in range(4)]

    def write(tier):
        for e in entries:  # every writer writes both keys
            tier.write(e.tokens, e.cache, {}, True)

    threads = [threading.Thread(target=write, args=(t,)) for t in tiers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    fresh = DiskTier(tmp_path, "a", 1 << 30)
    assert len(fresh.entries) == 2 and not list((tmp_path / "a").glob(".*"))
    for key in fresh.entries:
        assert fresh.read(key) is not None


def test_copies_for_the_cache_are_bounded_by_its_budget_only_without_a_disk_tier(tmp_path):
    # the continuous lane's copies (boundaries, block snapshots) past the RAM budget are worth making only where a
    # disk tier takes what the budget evicts
    assert PromptCache(1 << 20).copy_budget() == 1 << 20
    assert PromptCache(1 << 20, DiskTier(tmp_path, "a", 1 << 30)).copy_budget() is None
