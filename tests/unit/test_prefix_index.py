"""The prompt cache's sorted index: every key once, longest common prefix first, and lookups that pick what a
scan over every entry picks."""

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.cache.prefix_index import PrefixIndex, common_prefix
from engine.cache.prompt_cache import PromptCache, _start
from engine.request import CachedPrefix

# short sequences over few token values: many shared prefixes, prefixes of one another, ties
tokens = st.lists(st.integers(0, 2), min_size=1, max_size=6).map(tuple)


def brute_common(a, b) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.booleans(), tokens), max_size=30), tokens)
def test_the_index_walks_every_key_once_longest_common_prefix_first(ops, query):
    index, keys = PrefixIndex(), set()
    for add, key in ops:  # adds and removes in any order (a removal of a key not held is skipped)
        if add and key not in keys:
            index.add(key, np.asarray(key), value=key)
            keys.add(key)
        elif not add and key in keys:
            index.remove(key)
            keys.discard(key)
    walked = list(index.nearest(query, np.asarray(query)))
    assert sorted(k for k, _ in walked) == sorted(keys) and len(index) == len(keys)
    assert all(c == brute_common(k, query) for k, c in walked)
    assert [c for _, c in walked] == sorted((c for _, c in walked), reverse=True)


def test_the_index_refuses_a_key_twice_and_a_key_it_does_not_hold():
    index = PrefixIndex()
    index.add((1, 2), np.asarray([1, 2]))
    try:
        index.add((1, 2), np.asarray([1, 2]))
        raise AssertionError("a second add of one key was taken")
    except ValueError:
        pass
    try:
        index.remove((1,))
        raise AssertionError("a key never added was removed")
    except KeyError:
        pass
    assert common_prefix(np.asarray([1, 2, 3]), np.asarray([1, 2])) == 2


@dataclass
class Layer:
    """A cache layer the prompt cache treats as opaque: rewinds or not, has a size."""

    trimmable: bool
    owner: tuple  # the entry's tokens: which entry a hit's caches came from
    nbytes: int = 1

    def is_trimmable(self) -> bool:
        return self.trimmable

    def trim(self, n: int) -> None:
        pass


def scan(pc: PromptCache, prompt, draft=None):
    """The lookup's choice by comparing the prompt with every entry, oldest first: (tokens, start) or None."""
    limit = len(prompt) - 1
    best, best_n = None, 0
    for key, e in pc._entries.items():
        common = brute_common(key, prompt)
        if draft is None:
            n = _start(e.ids, e.trimmable, e.snapshots, common, limit)
        else:
            whole = len(key) <= limit and common == len(key)
            n = len(key) if whole and getattr(e.draft, "kind", None) == draft else 0
        if n > best_n and n >= pc._min_start:
            best, best_n = key, n
    return None if best is None else (best, best_n)


def chosen(hit):
    return None if hit is None else (hit.cache[0].owner, len(hit.tokens))


@dataclass
class Draft:
    kind: str
    nbytes: int = 1


entry = st.tuples(
    st.lists(st.integers(0, 2), min_size=1, max_size=8).map(tuple),
    st.booleans(),  # trimmable (growing KV) or not (recurrent state)
    st.sets(st.integers(1, 7), max_size=3),  # block snapshots at these lengths
    st.sampled_from([None, "mtp"]),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(entry, st.booleans()), max_size=25), st.lists(tokens, min_size=1, max_size=6))
def test_a_lookup_picks_what_a_scan_over_every_entry_picks(stores, prompts):
    """Insertions, lookups (which make an entry the newest) and budget evictions in any order; ties go to the
    entry least recently used, as a scan oldest-first picks them."""
    pc, drafts = PromptCache(max_bytes=12), {}  # drafts: whether each key's entry holds a draft's state
    for (key, trimmable, blocks, draft), hit in stores:
        snaps = tuple((n, [Layer(False, key)]) for n in sorted(blocks))
        before = [k for k in pc._entries if k != key]  # oldest first
        if pc.insert(CachedPrefix(key, [Layer(trimmable, key)], snaps, Draft(draft) if draft else None)):
            # a trimmable entry replaces the entries that are its prefixes (not those with a draft's state); then
            # the budget evicts the oldest of the rest
            kept = [k for k in before if not (trimmable and k == key[: len(k)] and not drafts.get(k))]
            after = [k for k in pc._entries if k != key]
            assert after == kept[len(kept) - len(after) :]
            drafts[key] = draft is not None
        if hit:  # a lookup between insertions makes its entry the newest, as a request's would
            want = scan(pc, key + (0,))
            assert chosen(pc.lookup(key + (0,))) == want
    for prompt in prompts:
        for kind in (None, "mtp"):
            want = scan(pc, prompt, kind)
            assert chosen(pc.lookup(prompt, kind)) == want


def test_the_lookup_cost_tool_times_both_kinds_of_prompt():
    root = Path(__file__).resolve().parents[2]  # `tools/` is run from the checkout, as its docstring says
    cmd = [sys.executable, "-m", "tools.prompt_cache_lookup", "--entries", "20", "--shared", "300", "--tail", "10"]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True).stdout
    assert "20 entries of 300 shared + 10 own tokens" in out
    assert "sharing the system prompt:" in out and "sharing nothing:" in out
