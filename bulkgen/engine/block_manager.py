"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, and prefix caching by chained block hashes.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes.
Blocks whose ref count drops to zero stay hashed in an LRU free list and are revived on a hit, so a
system prompt shared by thousands of rows is computed once while memory allows.
The pool is lazy: never-used ids come from a counter and a `Block` exists only once its id is handed out,
because a large GPU holds tens of millions of blocks and one object per block cost seconds and gigabytes.
"""

from __future__ import annotations

from collections import OrderedDict

from .sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None


class BlockManager:
    """Owns the block pool; sequences hold block ids in `seq.block_table`."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks: list[Block] = []  # blocks[i] for every id ever handed out, i.e. i < next_fresh
        self.next_fresh = 0  # ids from here up were never used; they are taken before any freed id
        self.freed: OrderedDict[int, None] = OrderedDict()  # ref count zero, oldest first (LRU)
        self.hash_to_block: dict[int, int] = {}
        self._hashed: dict[int, tuple[int, int | None]] = {}  # seq_id -> (num hashed blocks, last hash)

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.next_fresh + len(self.freed)

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
        if revived + fresh > self.num_free_blocks:
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
        if need > self.num_free_blocks:
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
                self.freed[block_id] = None
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
            del self.freed[block_id]
        block.ref_count += 1

    def _take_free(self) -> int:
        """A never-used id (lowest first) while any is left, else the block freed longest ago."""
        if self.next_fresh < self.num_blocks:
            block = Block(self.next_fresh)
            self.blocks.append(block)
            self.next_fresh += 1
        else:
            block_id, _ = self.freed.popitem(last=False)
            block = self.blocks[block_id]
            if block.hash is not None:
                if self.hash_to_block.get(block.hash) == block_id:
                    del self.hash_to_block[block.hash]
                block.hash, block.token_ids = None, None
        block.ref_count = 1
        return block.block_id
