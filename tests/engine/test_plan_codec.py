"""The tensor-parallel step plan over steps of real sequences whose tables a real BlockManager grows,
releases (a preemption) and gives again: the follower's stand-ins always hold rank 0's tables, while a
steady decode step sends only the entries added since the last one."""

from __future__ import annotations

import torch

from bulkgen.engine import SamplingParams
from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.features.lora import LoraAdapter
from bulkgen.engine.features.lora_slots import LoraSlots
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.parallel.plan_codec import PlanDecoder, PlanEncoder
from bulkgen.engine.sequence import Request, Sequence

BLOCK = 4


def _sequences(count: int) -> list[Sequence]:
    params = SamplingParams(max_tokens=64)
    return [Sequence(i, Request(str(i), list(range(10 + i)), params, i), 0, 64) for i in range(count)]


def _step(encoder: PlanEncoder, decoder: PlanDecoder, seqs: list[Sequence], graph=None) -> tuple[list, int]:
    """Send one decode step of `seqs`; returns what the follower rebuilt and the plan's size in bytes."""
    raw = encoder.encode([(s, 1) for s in seqs], len(seqs), graph)
    batch, rows, got_graph = decoder.decode(raw)
    assert rows == len(seqs) and got_graph == graph
    for (stand_in, n), seq in zip(batch, seqs, strict=True):
        assert n == 1 and stand_in.seq_id == seq.seq_id
        assert stand_in.block_tables == seq.block_tables  # every group's table, entry for entry
        assert stand_in.token_ids[seq.num_computed_tokens] == seq.token_ids[seq.num_computed_tokens]
    return batch, len(raw)


def test_followers_rebuild_every_table_from_entries_sent_once():
    manager = BlockManager(64, BLOCK, enable_prefix_caching=False, kinds=[FULL, AttnKind(window=8)])
    seqs = _sequences(3)
    for seq in seqs:
        assert manager.admit(seq, None, len(seq.token_ids))
        seq.num_computed_tokens = len(seq.token_ids) - 1
    encoder, decoder = PlanEncoder(), PlanDecoder()
    _, whole = _step(encoder, decoder, seqs, graph=(3, 16))
    sizes = []
    for _ in range(6):  # decode: a new block every BLOCK tokens, appended to each group's table
        for seq in seqs:
            seq.token_ids.append(7)
            seq.num_computed_tokens += 1
            assert manager.grow(seq, seq.num_computed_tokens + 1)
        batch, size = _step(encoder, decoder, seqs)
        sizes.append(size)
    assert max(sizes) < whole  # the tables are not sent again
    kept = batch[1][0].block_tables
    manager.release(seqs[1])  # preempted: recomputed later into fresh tables
    assert manager.admit(seqs[1], None, len(seqs[1].token_ids))
    _step(encoder, decoder, seqs)
    _step(encoder, decoder, [seqs[0], seqs[2]])  # sequence 1 skips a step: the mirrors drop it
    batch, _ = _step(encoder, decoder, seqs)  # and it is sent whole again
    assert batch[1][0].block_tables is not kept and batch[0][0].block_tables is decoder.held[0]


def test_lora_section_carries_slots_rows_and_the_adapter_set_when_it_changes():
    """Rank 0's slot of each resident adapter every step, each row's adapter, and the set of adapters it
    holds only in the plan after that set changed (lora_tp.follow loads or drops them on a follower)."""
    slots = LoraSlots(torch.nn.Linear(2, 2), max_loras=2, max_rank=4)  # adapters targeting no layer
    a, b = (LoraAdapter(name, f"/adapters/{name}", 4, {}) for name in "ab")
    slots.add(a)
    slots.add(b)
    slots.activate({b})
    seqs = _sequences(3)
    seqs[1].lora = b
    encoder, decoder = PlanEncoder(), PlanDecoder()

    def step() -> list:
        batch, _, _ = decoder.decode(encoder.encode([(s, 1) for s in seqs], 0, None, slots))
        return [None if s.lora is None else s.lora.uid for s, _ in batch]

    assert step() == [None, b.uid, None]
    assert decoder.loras.resident == {b.uid: 0} and decoder.loras.loaded == sorted([a.uid, b.uid])
    seqs[1].lora, seqs[2].lora = None, a
    slots.activate({a})
    assert step() == [None, None, a.uid]
    assert decoder.loras.resident == {b.uid: 0, a.uid: 1} and decoder.loras.loaded is None  # unchanged
    slots.remove("b")
    step()
    assert decoder.loras.resident == {a.uid: 1} and decoder.loras.loaded == [a.uid]


def test_followers_rebuild_each_chunks_image_positions_blocks_and_mrope_positions():
    """A prefill chunk reaching an image, a decode past the prompt (M-RoPE: p + delta) and a text
    sequence in one step: the follower's stand-ins hold what rank 0's splice, positions and image blocks
    read of them, with the LoRA section after it; a text-only step carries no images section."""
    from bulkgen.engine.features.image_blocks import runs
    from bulkgen.engine.features.multimodal import ImageInputs, RequestImages

    prompt = [1, 2, 3, 99, 99, 99, 99, 4, 99, 99, 5, 6]
    seqs = _sequences(3)
    for seq in seqs[:2]:
        images = RequestImages(ImageInputs(torch.zeros(2, 3), ["a", "b"], [4, 2]), prompt, 99)
        images.blocks = runs(images.rows)
        images.mrope, images.mrope_delta = torch.arange(3 * len(prompt)).reshape(3, -1), -3
        seq.request.images = images
    seqs[0].num_computed_tokens = 5  # a chunk of 5: positions 5..9
    seqs[1].token_ids.extend([7] * 4)
    seqs[1].num_computed_tokens = len(prompt) + 2  # decoding past its prompt
    text = PlanEncoder().encode([(seqs[2], 1)], 0, None)
    slots = LoraSlots(torch.nn.Linear(2, 2), max_loras=2, max_rank=4)
    slots.add(LoraAdapter("a", "/adapters/a", 4, {}))
    decoder = PlanDecoder()
    batch, _, _ = decoder.decode(
        PlanEncoder().encode([(seqs[0], 5), (seqs[1], 1), (seqs[2], 1)], 0, None, slots)
    )
    assert decoder.loras.loaded == [slots.adapters["a"].uid]
    (chunk, _), (decode, _), (plain, _) = batch
    assert chunk.request.images.rows == [5, 6, 8, 9]
    assert (chunk.request.images.first_row, chunk.request.images.last_row) == (3, 9)
    assert chunk.request.images.blocks == [(3, 7), (8, 10)]
    for stand_in, seq, n in ((chunk, seqs[0], 5), (decode, seqs[1], 1)):
        start = seq.num_computed_tokens
        want = seq.request.images.mrope_rows(start, n)
        assert torch.equal(stand_in.request.images.mrope_rows(start, n), want)
    assert decode.request.images.rows == [] and decode.request.images.blocks == []
    assert plain.request.images is None
    assert len(PlanDecoder().decode(text)[0]) == 1 and len(text) == 8 * (5 + 13 + 1)
