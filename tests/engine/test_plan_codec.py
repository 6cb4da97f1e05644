"""The tensor-parallel step plan over steps of real sequences whose tables a real BlockManager grows,
releases (a preemption) and gives again: the follower's stand-ins always hold rank 0's tables, while a
steady decode step sends only the entries added since the last one. The features' plan sections (LoRA,
images) travel beside it, registered with real rank groups, in name order."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from bulkgen.engine import SamplingParams
from bulkgen.engine.attention.layer_attention import FULL, AttnKind
from bulkgen.engine.features.image_plan import ImagesSection
from bulkgen.engine.features.lora_slots import LoraSlots
from bulkgen.engine.kv.block_manager import BlockManager
from bulkgen.engine.parallel.plan_codec import PlanDecoder, PlanEncoder
from bulkgen.engine.parallel.tensor_parallel import RankGroup
from bulkgen.engine.sequence import Request, Sequence
from bulkgen.engine.step_features import PlanSection
from bulkgen.lab.tiny_lora import save_random_adapter

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


@pytest.fixture
def groups():
    """Rank 0's and a follower's rank groups: real groups of one process each (no collective runs here),
    whose features register their plan sections with them as on two ranks."""
    pair = [RankGroup.join("127.0.0.1", 0, 0, 1, "cpu", 30) for _ in range(2)]
    yield pair
    for group in pair:
        group.close()


def test_lora_section_gives_the_follower_rank_0s_adapters_slots_and_rows(groups, tiny_model, tmp_path):
    """Rank 0's slot of each resident adapter every step, each row's adapter, and the adapters it holds:
    a follower's LoraSlots loads each new adapter from the folder the plan names once, drops a removed
    one, and ends with rank 0's slots holding the same weights."""
    path = tiny_model("llama", seed=3)
    leader, follower = groups
    slots = [
        LoraSlots(AutoModelForCausalLM.from_pretrained(path), 2, 8, group) for group in (leader, follower)
    ]
    for name, seed in (("a", 1), ("b", 2)):
        folder = save_random_adapter(path, tmp_path / name, seed, 4, 8, ("q_proj", "o_proj"))
        slots[0].add(slots[0].load(name, folder))
    a, b = slots[0].adapters["a"], slots[0].adapters["b"]
    slots[0].activate({b})
    seqs = _sequences(3)
    seqs[1].lora = b

    def step() -> tuple[list, int]:
        raw = leader.encoder.encode([(s, 1) for s in seqs], 0, None)
        batch, _, _ = follower.decoder.decode(raw)
        held = {n: x.uid for n, x in slots[1].adapters.items()}
        assert dict(slots[1].resident) == dict(slots[0].resident) and held == {
            n: x.uid for n, x in slots[0].adapters.items()
        }
        return [None if s.lora is None else s.lora.uid for s, _ in batch], len(raw)

    rows, first = step()
    assert rows == [None, b.uid, None] and dict(slots[1].resident) == {b.uid: 0}
    layer = "model.layers.0.self_attn.q_proj"
    assert torch.equal(slots[1].layers[layer].lora_a[0], slots[0].layers[layer].lora_a[0])
    seqs[1].lora, seqs[2].lora = None, a
    slots[0].activate({a})
    rows, size = step()
    assert rows == [None, None, a.uid] and dict(slots[1].resident) == {b.uid: 0, a.uid: 1}
    assert size < first  # the adapter set did not change: neither it nor a folder is sent again
    assert torch.equal(slots[1].layers[layer].lora_b[1], slots[0].layers[layer].lora_b[1])
    seqs[2].lora = None
    slots[0].remove("b")
    assert step()[0] == [None, None, None] and set(slots[1].adapters) == {"a"}


def test_sections_travel_in_name_order_whatever_order_features_register_them(groups):
    """Each rank builds its features in its own order; the plan carries their sections by name, and a
    second section of one name is refused."""
    leader, follower = groups
    leader.register(ImagesSection())
    leader.register(_Counting("b"))
    leader.register(_Counting("a"))
    for section in (_Counting("a"), ImagesSection(), _Counting("b")):
        follower.register(section)
    assert [s.name for s in leader.sections] == [s.name for s in follower.sections] == ["a", "b", "images"]
    seqs = _sequences(2)
    batch, _, _ = follower.decoder.decode(leader.encoder.encode([(s, 1) for s in seqs], 0, None))
    assert [s.seen for s in follower.sections[:2]] == [["a", 0, 1], ["b", 0, 1]]
    assert all(stand_in.request.images is None for stand_in, _ in batch)  # text only: no images section ints
    with pytest.raises(ValueError, match="'a' is registered already"):
        leader.register(_Counting("a"))


class _Counting(PlanSection):
    """A section that sends its name's letter and each row's index, and keeps what it decoded."""

    def __init__(self, name: str) -> None:
        self.name, self.seen = name, None

    def encode(self, batch: list) -> list[int]:
        return [ord(self.name), *range(len(batch))]

    def decode(self, ints: list[int], batch: list) -> None:
        self.seen = [chr(ints[0]), *ints[1:]]


def test_followers_rebuild_each_chunks_image_positions_blocks_and_mrope_positions():
    """A prefill chunk reaching an image, a decode past the prompt (M-RoPE: p + delta) and a text
    sequence in one step: the follower's stand-ins hold what rank 0's splice, positions and image blocks
    read of them; a text-only step's images section is empty."""
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
    text = PlanEncoder([ImagesSection()]).encode([(seqs[2], 1)], 0, None)
    decoder = PlanDecoder([ImagesSection()])
    batch, _, _ = decoder.decode(
        PlanEncoder([ImagesSection()]).encode([(seqs[0], 5), (seqs[1], 1), (seqs[2], 1)], 0, None)
    )
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
    ((stand_in, _),) = PlanDecoder([ImagesSection()]).decode(text)[0]
    assert stand_in.request.images is None
    assert len(text) == 8 * (4 + 9 + 1 + 1)  # header, item, its token, the empty images section's size
