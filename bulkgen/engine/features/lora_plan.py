"""LoRA's section of the tensor-parallel step plan (step_features.PlanSection): every rank's slots hold the
same adapters, in the slots rank 0 chose.

Rank 0 decides which adapter sits in which slot (LoraSlots.activate, its LRU); each step's section carries
that assignment as (uid, slot) pairs, the uids of every adapter rank 0 holds when that set changed since
the previous plan (-1: unchanged), the name and folder of each adapter no plan has named yet, and each
row's adapter uid when any row has one. A follower loads its own shard of a new adapter from that folder
(LoraSlots.load: the rank group splits it, lora_tp.py), drops removed ones and copies the assignment, so
its slots, its row order (sorted by uid) and its segments are rank 0's.
"""

from __future__ import annotations

import json

from bulkgen.engine.step_features import PlanSection


class AdapterRef:
    """A follower stand-in's adapter: the uid rank 0 gave it, which the runner sorts and slots rows by."""

    __slots__ = ("uid",)

    def __init__(self, uid: int) -> None:
        self.uid = uid


class LoraSection(PlanSection):
    name = "lora"

    def __init__(self, slots) -> None:
        """`slots`: this rank's lora_slots.LoraSlots (rank 0's are read, a follower's filled)."""
        self.slots = slots
        self.loaded: list[int] = []  # rank 0: the uids the previous plan named
        self.named: set[int] = set()  # rank 0: uids whose folder a plan has carried
        self.folders: dict[
            int, tuple[str, str]
        ] = {}  # a follower: uid -> (name, folder), as rank 0 sent them

    def encode(self, batch: list) -> list[int]:
        slots = self.slots
        ints = [len(slots.resident), *(v for pair in slots.resident.items() for v in pair)]
        loaded = sorted(a.uid for a in slots.adapters.values())
        if loaded == self.loaded:
            ints.append(-1)
        else:
            ints += [len(loaded), *loaded]
            self.loaded, self.named = loaded, self.named & set(loaded)  # a uid never comes back once removed
        new = [a for a in slots.adapters.values() if a.uid not in self.named]
        ints.append(len(new))
        for adapter in new:
            folder = json.dumps([adapter.name, str(adapter.path)]).encode()
            ints += [adapter.uid, len(folder), *folder]
            self.named.add(adapter.uid)
        uids = [0 if seq.lora is None else seq.lora.uid for seq, _ in batch]
        return ints + ([len(uids), *uids] if any(uids) else [0])

    def decode(self, ints: list[int], batch: list) -> None:
        pairs, at = ints[1 : 1 + 2 * ints[0]], 1 + 2 * ints[0]
        loaded = None if ints[at] < 0 else ints[at + 1 : at + 1 + ints[at]]
        at += 1 + max(ints[at], 0)
        count, at = ints[at], at + 1
        for _ in range(count):
            uid, size = ints[at], ints[at + 1]
            self.folders[uid] = tuple(json.loads(bytes(ints[at + 2 : at + 2 + size])))
            at += 2 + size
        uids = ints[at + 1 : at + 1 + ints[at]]
        for i, (seq, _) in enumerate(batch):
            seq.lora = AdapterRef(uids[i]) if i < len(uids) and uids[i] else None
        if loaded is not None:
            self._hold(loaded)
        self.slots.place(dict(zip(pairs[::2], pairs[1::2], strict=True)))

    def _hold(self, loaded: list[int]) -> None:
        """Hold the adapters rank 0 holds: drop removed ones, load new ones' shards."""
        slots, keep = self.slots, set(loaded)
        for name in [n for n, a in slots.adapters.items() if a.uid not in keep]:
            slots.remove(name)
        held = {a.uid for a in slots.adapters.values()}
        for uid in loaded:
            if uid not in held:
                name, folder = self.folders.pop(uid)
                adapter = slots.load(name, folder)
                adapter.uid = uid  # rank 0's: rows are sorted and slotted by it
                slots.add(adapter)
