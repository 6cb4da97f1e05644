"""Paged KV-cache bookkeeping: fixed-size blocks, ref counts, prefix caching by chained block hashes, and
one block table per group of layers (kv_layout), each keeping only the blocks its layers still read.

A full block's hash covers its tokens and its parent's hash, so equal hashes mean equal prefixes (an
image's placeholder tokens are hashed as its content's key: Sequence.hash_ids).
The chain's root is the sequence's `hash_root` (its LoRA adapter, None for the base model): the same
tokens under different weights give different K/V, so they never share blocks.
Blocks whose ref count drops to zero stay hashed in an LRU free list and are revived on a hit, so a
system prompt shared by thousands of rows is computed once while memory allows.
The pool is lazy: never-used ids come from a counter and a `Block` exists only once its id is handed out,
because a large GPU holds tens of millions of blocks and one object per block cost seconds and gigabytes.

Groups (vLLM's hybrid KV-cache manager, `single_type_kv_cache_manager.py`): every group's table covers
the same logical blocks and grows in step with the others, from one pool of ids. A sliding-window or
chunked group gives back the blocks wholly before the first position its next query reads (`slide`,
called by the scheduler before a sequence's next step), and its table holds `null_block` there, an id
no query reads. A prefix hit of m blocks needs, in each group, the blocks that the queries from position
m * block_size on read: all m for a full group, only the window's last ones for a sliding group; a
cached block behind a window is never needed, and one inside it must still be cached. Admission, growth
and preemption count the blocks of every group.
"""

from __future__ import annotations

from collections import OrderedDict

from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids", "group")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: tuple[int, ...] | None = None
        self.group = 0  # the group whose layers' K/V it holds while hashed


class PrefixHit:
    """The cached blocks a waiting sequence can start from: its first `len()` logical blocks, as each
    group's table (the null block where that group's next queries read nothing)."""

    def __init__(self, tables: list[list[int]], num_blocks: int, last_hash: int) -> None:
        self.tables, self.num_blocks, self.last_hash = tables, num_blocks, last_hash

    def __len__(self) -> int:
        return self.num_blocks


class BlockManager:
    """Owns the block pool; a sequence holds its block ids in `seq.block_tables`, one table per group."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        kinds: list[AttnKind] | None = None,
    ):
        """`kinds`: each group's attention kind (KVLayout.kinds); default one full group."""
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.null_block = num_blocks  # the runner's scratch block, past the pool: never handed out
        self.enable_prefix_caching = enable_prefix_caching
        self.kinds = kinds or [FULL]
        self.sliding = [g for g, kind in enumerate(self.kinds) if not kind.is_full]
        self.blocks: list[Block] = []  # blocks[i] for every id ever handed out, i.e. i < next_fresh
        self.next_fresh = 0  # ids from here up were never used; they are taken before any freed id
        self.freed: OrderedDict[int, None] = OrderedDict()  # ref count zero, oldest first (LRU)
        self.hash_to_block: list[dict[int, int]] = [{} for _ in self.kinds]  # per group
        self._hashed: dict[int, tuple[int, int | None]] = {}  # seq_id -> (num hashed blocks, last hash)
        self._behind: dict[int, list[int]] = {}  # seq_id -> per sliding group: leading blocks given back

    @property
    def num_free_blocks(self) -> int:
        return self.num_blocks - self.next_fresh + len(self.freed)

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs (over all groups) so its tables cover `num_tokens` tokens."""
        return len(self.kinds) * max(0, -(-num_tokens // self.block_size) - len(seq.block_table))

    def match_prefix(self, seq: Sequence) -> PrefixHit | None:
        """Cached blocks equal to the prefix of `seq` (never the block holding its last token), as long
        as every group holds what the following queries read; None without a hit."""
        if not self.enable_prefix_caching:
            return None
        chain = _Chain(seq.hash_ids, self.block_size, seq.hash_root)
        top = (len(seq) - 1) // self.block_size
        for g, kind in enumerate(self.kinds):
            if kind.is_full:
                m = 0
                while m < top and self._cached(g, chain, m) is not None:
                    m += 1
                top = m
        for m in range(top, 0, -1):
            needs = [
                (g, self.kinds[g].first_visible(m * self.block_size) // self.block_size) for g in self.sliding
            ]
            if all(
                self._cached(g, chain, j) is not None for g, lo in needs for j in range(m - 1, lo - 1, -1)
            ):
                return self._hit(chain, m)
        return None

    def _cached(self, group: int, chain: _Chain, index: int) -> int | None:
        h, tokens = chain[index]
        block_id = self.hash_to_block[group].get(h)
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return None
        return block_id

    def _hit(self, chain: _Chain, m: int) -> PrefixHit:
        tables = []
        for g, kind in enumerate(self.kinds):
            lo = kind.first_visible(m * self.block_size) // self.block_size
            tables.append([self.null_block] * lo + [self._cached(g, chain, j) for j in range(lo, m)])
        return PrefixHit(tables, m, chain[m - 1][0])

    def first_block_hash(self, seq: Sequence) -> int | None:
        """Hash of the first full block (None without prefix caching or a full block to share)."""
        if not self.enable_prefix_caching or len(seq) <= self.block_size:
            return None
        return hash((seq.hash_root, tuple(seq.hash_ids[: self.block_size])))

    def admit(self, seq: Sequence, cached: PrefixHit | None, num_tokens: int) -> bool:
        """Give a waiting `seq` its cached prefix blocks plus fresh ones up to `num_tokens`; False if short."""
        tables = cached.tables if cached else [[] for _ in self.kinds]
        held = [b for table in tables for b in table if b != self.null_block]
        revived = sum(1 for b in held if self.blocks[b].ref_count == 0)
        num_cached = len(cached) if cached else 0
        fresh = len(self.kinds) * max(0, -(-num_tokens // self.block_size) - num_cached)
        if revived + fresh > self.num_free_blocks:
            return False
        for block_id in held:
            self._ref(block_id)
        seq.block_tables = [list(table) for table in tables]
        seq.num_computed_tokens = num_cached * self.block_size
        if cached:
            self._hashed[seq.seq_id] = (num_cached, cached.last_hash)
        if self.sliding:
            self._behind[seq.seq_id] = [tables[g].count(self.null_block) for g in self.sliding]
        return self.grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Append fresh blocks so `seq` can hold `num_tokens` tokens; False (nothing taken) if short."""
        need = self.blocks_needed(seq, num_tokens)
        if need > self.num_free_blocks:
            return False
        for _ in range(need // len(self.kinds)):
            for table in seq.block_tables:
                table.append(self._take_free())
        return True

    def slide(self, seq: Sequence) -> None:
        """Give back each sliding group's blocks wholly before what `seq`'s next query reads (its next
        token, at num_computed_tokens, and every later one read from there on)."""
        behind = self._behind.get(seq.seq_id)
        if behind is None:
            return
        for i, g in enumerate(self.sliding):
            lo = self.kinds[g].first_visible(seq.num_computed_tokens) // self.block_size
            table = seq.block_tables[g]
            for j in range(behind[i], min(lo, len(table))):
                self._unref(table[j])
                table[j] = self.null_block
            behind[i] = max(behind[i], min(lo, len(table)))

    def release(self, seq: Sequence) -> None:
        """Drop `seq`'s references; tail blocks go to the free list first so prefixes survive longest."""
        tables = seq.block_tables
        for j in range(len(seq.block_table) - 1, -1, -1):
            for table in tables:
                self._unref(table[j])
        seq.block_tables = []
        self._hashed.pop(seq.seq_id, None)
        self._behind.pop(seq.seq_id, None)

    def commit(self, seq: Sequence) -> None:
        """Hash the blocks of `seq` that became full and computed, so later sequences can share them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        done, parent = self._hashed.get(seq.seq_id, (0, seq.hash_root))
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        keyed = seq.hash_ids
        for i in range(done, full):
            tokens = tuple(keyed[i * bs : (i + 1) * bs])
            parent = hash((parent, tokens))
            for g, table in enumerate(seq.block_tables):
                if table[i] == self.null_block:
                    continue
                block, known = self.blocks[table[i]], self.hash_to_block[g]
                if block.hash is None and parent not in known:
                    block.hash, block.token_ids, block.group = parent, tokens, g
                    known[parent] = block.block_id
        if full > done:
            self._hashed[seq.seq_id] = (full, parent)

    def _ref(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.freed[block_id]
        block.ref_count += 1

    def _unref(self, block_id: int) -> None:
        if block_id == self.null_block:
            return
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count == 0:
            self.freed[block_id] = None

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
                known = self.hash_to_block[block.group]
                if known.get(block.hash) == block_id:
                    del known[block.hash]
                block.hash, block.token_ids = None, None
        block.ref_count = 1
        return block.block_id


class _Chain:
    """The chained (hash, tokens) of a sequence's full blocks, computed as far as they are asked for."""

    def __init__(self, token_ids: list[int], block_size: int, root: object = None) -> None:
        self.token_ids, self.block_size, self.root = token_ids, block_size, root
        self.keys: list[tuple[int, tuple[int, ...]]] = []

    def __getitem__(self, index: int) -> tuple[int, tuple[int, ...]]:
        bs, keys = self.block_size, self.keys
        while len(keys) <= index:
            i = len(keys)
            tokens = tuple(self.token_ids[i * bs : (i + 1) * bs])
            keys.append((hash((keys[-1][0] if keys else self.root, tokens)), tokens))
        return keys[index]
