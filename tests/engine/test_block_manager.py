"""The lazy BlockManager against the eager implementation it replaced, driven through the same random work."""

from __future__ import annotations

import random
from collections import OrderedDict

import pytest

from bulkgen.engine import SamplingParams
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.sequence import Request, Sequence


class _OldBlock:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class OldBlockManager:
    """The eager BlockManager this module replaced, verbatim: one object per block, every id in `free`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [_OldBlock(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.hash_to_block: dict[int, int] = {}
        self._hashed: dict[int, tuple[int, int | None]] = {}  # seq_id -> (num hashed blocks, last hash)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs so its table covers `num_tokens` tokens."""
        return max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks equal to the prefix of `seq` (never the block holding its last token)."""
        if not self.enable_prefix_caching:
            return []
        matched, parent = [], None
        bs = self.block_size
        for i in range((len(seq) - 1) // bs):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            h = hash((parent, tokens))
            block_id = self.hash_to_block.get(h)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            matched.append(block_id)
            parent = h
        return matched

    def first_block_hash(self, seq: Sequence) -> int | None:
        """Hash of the first full block (None without prefix caching or a full block to share)."""
        if not self.enable_prefix_caching or len(seq) <= self.block_size:
            return None
        return hash((None, tuple(seq.token_ids[: self.block_size])))

    def admit(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Give a waiting `seq` its cached prefix blocks plus fresh ones up to `num_tokens`; False if short."""
        revived = sum(1 for b in cached if self.blocks[b].ref_count == 0)
        fresh = max(0, -(-num_tokens // self.block_size) - len(cached))
        if revived + fresh > len(self.free):
            return False
        for block_id in cached:
            self._ref(block_id)
        seq.block_table = list(cached)
        seq.num_computed_tokens = len(cached) * self.block_size
        if cached:
            last = self.blocks[cached[-1]].hash
            self._hashed[seq.seq_id] = (len(cached), last)
        return self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Append fresh blocks so `seq` can hold `num_tokens` tokens; False (nothing taken) if short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > len(self.free):
            return False
        for _ in range(need):
            seq.block_table.append(self._take_free())
        return True

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks go to the free list first so prefixes survive longest."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        self._hashed.pop(seq.seq_id, None)

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks of `seq` that became full and computed, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        done, parent = self._hashed.get(seq.seq_id, (0, None))
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        for i in range(done, full):
            tokens = tuple(seq.token_ids[i * bs : (i + 1) * bs])
            parent = hash((parent, tokens))
            block = self.blocks[seq.block_table[i]]
            if block.hash is None and parent not in self.hash_to_block:
                block.hash, block.token_ids = parent, tokens
                self.hash_to_block[parent] = block.block_id
        if full > done:
            self._hashed[seq.seq_id] = (full, parent)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not None:
            if self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]
            block.hash, block.token_ids = None, None
        block.ref_count = 1
        return block_id


def _seq(tokens, seq_id):
    request = Request(str(seq_id), list(tokens), SamplingParams(temperature=0), order=seq_id)
    return Sequence(seq_id, request, 0, max_tokens=4)


def test_construction_builds_no_per_block_state():
    bm = BlockManager(30_000_000, 16)
    assert len(bm.blocks) == 0 and len(bm.freed) == 0
    assert bm.num_free_blocks == 30_000_000
    seq = _seq(range(20), 0)
    assert bm.admit(seq, bm.match_prefix(seq), 20)
    assert seq.block_table == [0, 1] and len(bm.blocks) == 2 and bm.num_free_blocks == 30_000_000 - 2
    bm.release(seq)
    assert list(bm.freed) == [1, 0] and bm.num_free_blocks == 30_000_000


def _assert_same_state(new, old, pairs):
    assert new.num_free_blocks == old.num_free_blocks
    for a, b in pairs:
        assert a.block_table == b.block_table and a.num_computed_tokens == b.num_computed_tokens
    # old's free list is every never-used id in order, then the freed ones oldest first
    assert list(old.free) == list(range(new.next_fresh, new.num_blocks)) + list(new.freed)
    assert new.hash_to_block == [old.hash_to_block]  # one group: full attention
    assert len(new.blocks) == new.next_fresh
    for block, ref in zip(new.blocks, old.blocks[: new.next_fresh], strict=True):
        assert (block.block_id, block.ref_count, block.hash, block.token_ids) == (
            ref.block_id,
            ref.ref_count,
            ref.hash,
            ref.token_ids,
        )
    assert all(b.ref_count == 0 and b.hash is None for b in old.blocks[new.next_fresh :])


@pytest.mark.parametrize("seed,num_blocks,block_size", [(0, 12, 2), (1, 24, 4), (2, 40, 3), (3, 9, 1)])
def test_matches_eager_reference_step_by_step(seed, num_blocks, block_size):
    rng = random.Random(seed)
    new, old = BlockManager(num_blocks, block_size), OldBlockManager(num_blocks, block_size)
    bs = block_size
    prefixes = [[rng.randrange(4) for _ in range(rng.randrange(4 * bs))] for _ in range(3)]
    waiting: list[tuple[Sequence, Sequence]] = []
    running: list[tuple[Sequence, Sequence]] = []
    seen = {"hit": 0, "revived": 0, "evicted": 0, "refused": 0}
    next_id = 0

    def compute(pair, target):
        for seq, bm in zip(pair, (new, old), strict=True):
            seq.num_computed_tokens = target
            bm.commit(seq)

    for _ in range(1500):
        op = rng.random()
        if op < 0.2 or not (waiting or running):
            tokens = rng.choice(prefixes) + [rng.randrange(4) for _ in range(rng.randrange(1, 3 * bs))]
            waiting.append((_seq(tokens, next_id), _seq(tokens, next_id)))
            next_id += 1
        elif op < 0.45 and waiting:
            pair = waiting[rng.randrange(len(waiting))]
            a, b = pair
            cached = new.match_prefix(a)
            ids = cached.tables[0] if cached else []
            assert ids == old.match_prefix(b)
            seen["hit"] += bool(cached)
            seen["revived"] += sum(new.blocks[i].ref_count == 0 for i in ids)
            num_tokens = len(ids) * bs + rng.randint(1, len(a) - len(ids) * bs)
            hashed_before = len(new.hash_to_block[0])
            admitted = new.admit(a, cached, num_tokens)
            assert admitted == old.admit(b, list(ids), num_tokens)
            seen["evicted"] += len(new.hash_to_block[0]) < hashed_before
            if admitted:
                waiting.remove(pair)
                running.append(pair)
                compute(pair, num_tokens)
            else:
                seen["refused"] += 1
        elif op < 0.85 and running:
            pair = running[rng.randrange(len(running))]
            a, b = pair
            if a.num_computed_tokens == len(a):  # decode: the sampled token joins the sequence
                token = rng.randrange(4)
                a.token_ids.append(token)
                b.token_ids.append(token)
            target = min(len(a), a.num_computed_tokens + rng.randint(1, 2 * bs))
            hashed_before = len(new.hash_to_block[0])
            grown = new.grow(a, target)
            assert grown == old.grow(b, target)
            seen["evicted"] += len(new.hash_to_block[0]) < hashed_before
            if grown:
                compute(pair, target)
            else:  # preempted, recomputed later from scratch like the scheduler does
                seen["refused"] += 1
                running.remove(pair)
                new.release(a)
                old.release(b)
                a.num_computed_tokens = b.num_computed_tokens = 0
                waiting.append(pair)
        elif running:
            pair = running.pop(rng.randrange(len(running)))
            new.release(pair[0])
            old.release(pair[1])
        _assert_same_state(new, old, running + waiting)

    for pair in running:
        new.release(pair[0])
        old.release(pair[1])
    _assert_same_state(new, old, running)
    assert new.num_free_blocks == num_blocks
    assert all(seen.values()), seen  # the run reached prefix hits, revivals, evictions and full pools
