"""Images in the engine: a vision-language model's encoder beside its language model, and the image
embeddings spliced into the packed prompt at their placeholder tokens.

A vision-language checkpoint loads with AutoModelForImageTextToText; the engine runs its language model
through a causal-LM shell that shares the loaded modules (`text_model`), so the paged attention, the step
plan and the sampler see a plain decoder. `VisionTower` runs the encoder and projector
(`get_image_features`) for every request of a step whose prompt chunk reaches an image it has not encoded
yet, all of them in one call where their pixel tensors stack. The embeddings are kept on the request until
every one of its sequences has computed past its last image token, so a chunked prefill may split an
image's run anywhere (except in a model whose image tokens attend to each other: image_blocks.py); a
preempted sequence that needs them again has them encoded again.

Prefix caching keys each placeholder token by its image's content hash (`RequestImages.hash_ids`): two
prompts share cached blocks over an image only when the image is the same.

Families (CHECKED): LLaVA, Idefics3, SmolVLM and Mistral 3 (the text model's own 1-D positions), Qwen2-VL,
Qwen2.5-VL and Qwen3-VL (M-RoPE: 3-D positions per prompt from the model's own rule, `mrope_positions`;
Qwen3-VL's deepstack rows travel with each image row and reach the text model for the step's image tokens),
Gemma 3 (1-D positions; embeddings spliced into the text model's scaled token embeddings, as transformers
does; image blocks bidirectional: `BIDIRECTIONAL_IMAGES`, image_blocks.py). Others are refused by name at load
(`check_family`).
"""

from __future__ import annotations

import hashlib
from bisect import bisect_left
from dataclasses import dataclass, field

import torch

from bulkgen.engine.features import image_blocks
from bulkgen.engine.step_features import StepFeature

# model classes checked against transformers' generate (tests/engine/test_vision.py)
CHECKED = {
    "LlavaForConditionalGeneration",
    "Idefics3ForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3VLForConditionalGeneration",
    "Qwen2VLForConditionalGeneration",
    "SmolVLMForConditionalGeneration",
    "Mistral3ForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
}
# families whose image tokens attend to their whole image (each run of image tokens bidirectionally):
# chunked prefill and attention follow image_blocks.py for them
BIDIRECTIONAL_IMAGES = {"Gemma3ForConditionalGeneration"}


@dataclass
class ImageInputs:
    """One request's images as the model's processor prepared them (off the engine thread: `process`)."""

    pixel_values: torch.Tensor  # the processor's output for the request's images, in order
    hashes: list[str]  # each image's content hash, in order (prefix-cache keys): one per image
    # placeholder tokens of each image, in prompt order; None where the processor does not say (every
    # placeholder is then keyed by all the request's images together: correct, shares less)
    token_counts: list[int] | None = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)  # per-image encoder inputs (image_sizes)

    @property
    def nbytes(self) -> int:
        """The host memory its tensors take: what the worker's image memory budget counts until they are freed."""
        return self.pixel_values.nbytes + sum(t.nbytes for t in self.extras.values())


def image_hash(image) -> str:
    """A content hash of one decoded image (a PIL image: its mode, size and pixels)."""
    digest = hashlib.blake2b(f"{image.mode}{image.size}".encode(), digest_size=16)
    digest.update(image.tobytes())
    return digest.hexdigest()


# what a processor returns beside the pixels that is not an encoder input
_NOT_ENCODER = {"input_ids", "attention_mask", "pixel_values", "token_type_ids", "mm_token_type_ids"}


def process(processor, text: str, images: list) -> tuple[list[int], ImageInputs | None]:
    """The token ids of a rendered prompt `text` with each image's placeholders expanded by the model's
    processor, and its PIL `images` as the engine takes them (None without images). CPU work for a
    worker's preparing threads, never the engine thread."""
    if not images:
        return processor.tokenizer(text, add_special_tokens=False)["input_ids"], None
    out = processor(text=text, images=images, return_tensors="pt", add_special_tokens=False)
    extras = {k: v for k, v in out.items() if k not in _NOT_ENCODER and isinstance(v, torch.Tensor)}
    ids = out["input_ids"][0].tolist()
    counts = _counts(processor, images)
    if counts is not None and sum(counts) != ids.count(_placeholder_id(processor)):
        counts = None  # the processor counts the image's framing tokens too (Idefics3): not per placeholder
    return ids, ImageInputs(out["pixel_values"], [image_hash(i) for i in images], counts, extras)


def _placeholder_id(processor) -> int | None:
    """The token each image embedding replaces: the first of transformers' `image_token_ids` (Gemma 3's
    processor gives the name `image_token_id` to its begin-of-image token, not its soft image token)."""
    ids = getattr(processor, "image_token_ids", None) or [getattr(processor, "image_token_id", None)]
    return ids[0]


def _counts(processor, images: list) -> list[int] | None:
    """Placeholder tokens per image, from the processor's own count (transformers' _get_num_multimodal_tokens,
    as vLLM reads it); None for a processor without one."""
    try:
        data = processor._get_num_multimodal_tokens(image_sizes=[(i.height, i.width) for i in images])
    except (AttributeError, NotImplementedError, TypeError):
        return None
    counts = getattr(data, "num_image_tokens", None)
    return list(counts) if counts is not None and len(counts) == len(images) else None


class RequestImages:
    """A request's images inside the engine: where its placeholders are and, while its prefill needs
    them, their embeddings."""

    def __init__(self, inputs: ImageInputs, prompt: list[int], image_token_id: int) -> None:
        self.inputs = inputs
        self.rows = [i for i, t in enumerate(prompt) if t == image_token_id]  # prompt positions, in order
        counts = inputs.token_counts
        if counts is not None and sum(counts) != len(self.rows):
            raise ValueError(
                f"the prompt has {len(self.rows)} image tokens but its images take {sum(counts)}"
            )
        if not self.rows:
            raise ValueError("the request has images but its prompt has no image placeholder token")
        self.embeds: torch.Tensor | None = None  # [len(rows), hidden] while kept
        # M-RoPE models (Qwen-VL): the prompt's 3-D positions [3, prompt], by the model's own rule, computed
        # at admission; a position p after the prompt is p + mrope_delta on all three axes
        self.mrope: torch.Tensor | None = None
        self.mrope_delta = 0
        self.hash_prompt = _keyed(prompt, self.rows, inputs.hashes, counts)
        self.blocks: list[tuple[int, int]] = []  # image blocks read bidirectionally (BIDIRECTIONAL_IMAGES)

    @property
    def first_row(self) -> int:
        return self.rows[0]

    @property
    def last_row(self) -> int:
        return self.rows[-1]

    def mrope_rows(self, start: int, n: int) -> torch.Tensor:
        """[3, n] M-RoPE positions of the prompt's positions [start, start + n): its own table, then
        p + delta past its end."""
        table = self.mrope
        after = torch.arange(min(max(start, table.shape[1]), start + n), start + n) + self.mrope_delta
        return torch.cat([table[:, start : start + n], after.expand(3, -1)], 1)


def _keyed(prompt: list[int], rows: list[int], hashes: list[str], counts: list[int] | None) -> list[int]:
    """The prompt with each placeholder replaced by a key of its image's content: negative ints below
    any stand-in id (sequence.pending_id), so they never equal a real or pending token."""
    keyed = list(prompt)
    owners = [h for h, c in zip(hashes, counts, strict=True) for _ in range(c)] if counts else None
    whole = "".join(hashes)
    for i, row in enumerate(rows):
        key = owners[i] if owners else whole
        keyed[row] = -(1 << 62) - int(hashlib.blake2b(key.encode(), digest_size=7).hexdigest(), 16)
    return keyed


def check_family(model: torch.nn.Module) -> None:
    """Refuse, by name, a vision-language model whose image handling bulkgen has not checked."""
    _check_name(type(model).__name__)


def _check_name(name: str) -> None:
    if name in CHECKED:
        return
    raise ValueError(
        f"{name}: bulkgen does not run this vision-language model (not yet checked against transformers); "
        f"it runs {sorted(CHECKED)}"
    )


def text_model(vlm: torch.nn.Module) -> torch.nn.Module:
    """The language half of `vlm` as a causal LM that shares its modules (built on the meta device, so
    nothing is allocated twice): what the engine's runner, probes and sampler drive. A text config that
    transformers maps to no causal LM (Qwen2.5-VL's) gets a Llama shell, whose forward is the generic
    decoder-then-head every such model's is."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    language = vlm.get_decoder()
    with torch.device("meta"):
        try:
            causal = AutoModelForCausalLM.from_config(language.config)
        except ValueError:
            causal = LlamaForCausalLM(
                LlamaConfig(
                    hidden_size=8,
                    intermediate_size=8,
                    num_hidden_layers=1,
                    num_attention_heads=1,
                    vocab_size=8,
                )
            )
    causal.model = language
    causal.lm_head = vlm.lm_head
    causal.config = language.config
    causal.generation_config = vlm.generation_config
    causal.name_or_path = vlm.name_or_path
    # a checkpoint's quantizer marks the model it loaded: the engine must not quantize the shell again
    causal.is_quantized = getattr(vlm, "is_quantized", False)
    return causal.eval()


class VisionTower(StepFeature):
    """The encoder and projector of a vision-language model: pixel tensors in, one row of embeddings
    per placeholder token out. The step feature of such a model (step_features.py): it splices the
    embeddings into the forward's inputs and, where image tokens attend to their whole image, plans and
    routes the steps that reach image blocks."""

    def __init__(self, vlm: torch.nn.Module, processor=None) -> None:
        """`processor`: the model's processor as load_processor gives it (process() takes it)."""
        check_family(vlm)
        self.vlm = vlm.eval()
        self.processor = processor
        config = vlm.config
        self.image_token_id = getattr(config, "image_token_id", None)
        if self.image_token_id is None:
            self.image_token_id = config.image_token_index
        self.mrope = hasattr(vlm.model, "get_rope_index")  # 3-D positions (Qwen-VL's M-RoPE)
        self.bidirectional = type(vlm).__name__ in BIDIRECTIONAL_IMAGES
        # tensor parallel (tensor_parallel.RankGroup): rank 0 encodes and sends each step's image rows,
        # the other ranks (no encoder: drop_encoder) receive them; None: one process
        self.tp = getattr(vlm, "bulkgen_tp", None)

    def admit(self, prompt: list[int], inputs: ImageInputs) -> RequestImages:
        """A request's images as the engine keeps them; ValueError if they do not match its prompt."""
        images = RequestImages(inputs, prompt, self.image_token_id)
        if self.bidirectional:
            images.blocks = image_blocks.runs(images.rows)
        if self.mrope:
            ids = torch.tensor([prompt], device=self.vlm.device)
            extras = {k: v.to(self.vlm.device) for k, v in inputs.extras.items()}
            positions, delta = self.vlm.model.get_rope_index(
                input_ids=ids, mm_token_type_ids=(ids == self.image_token_id).int(), **extras
            )
            images.mrope, images.mrope_delta = positions[:, 0].cpu(), int(delta.reshape(-1)[0])
        return images

    @property
    def decode_graphs(self) -> bool:
        return not self.mrope  # the graphs' static buffers hold 1-D positions only

    def route(self, backend):
        """Steps reaching image blocks run plain (image_blocks.route) where images attend bidirectionally."""
        return image_blocks.route(backend) if self.bidirectional else backend

    def plan(self, plan, prefill: list) -> None:
        if self.bidirectional:
            plan.image_blocks = image_blocks.step_blocks(prefill)

    def inputs(self, ordered: list, input_ids: torch.Tensor, positions: torch.Tensor, embedding) -> dict:
        """The language model's inputs for a packed step: token ids, or embeddings with images spliced in;
        positions, 3-D under M-RoPE."""
        embeds, out = splice(self, ordered, input_ids, embedding)
        out.update({"input_ids": input_ids[None]} if embeds is None else {"inputs_embeds": embeds[None]})
        out["position_ids"] = mrope_positions(ordered, positions) if self.mrope else positions[None]
        return out

    def row_width(self, hidden: int) -> int:
        """The width of one image row the encoder gives: `hidden`, and Qwen3-VL's deepstack rows beside it."""
        deepstack = getattr(self.vlm.config.vision_config, "deepstack_visual_indexes", None) or ()
        return hidden * (1 + len(deepstack))

    @torch.inference_mode()
    def encode(self, requests: list[RequestImages]) -> None:
        """Fill `embeds` of every request given, stacking those whose pixel tensors share a shape into
        one encoder call."""
        groups: dict[tuple, list[RequestImages]] = {}
        for r in requests:
            key = (tuple(r.inputs.pixel_values.shape[1:]), tuple(sorted(r.inputs.extras)))
            groups.setdefault(key, []).append(r)
        for group in groups.values():
            self._encode_group(group)

    def _encode_group(self, group: list[RequestImages]) -> None:
        device, dtype = self.vlm.device, self.vlm.dtype
        pixels = torch.cat([r.inputs.pixel_values for r in group]).to(device, dtype)
        extras = {
            k: torch.cat([r.inputs.extras[k] for r in group]).to(device) for k in group[0].inputs.extras
        }
        out = self.vlm.get_image_features(pixel_values=pixels, return_dict=True, **extras)
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        per_image = [f.reshape(-1, f.shape[-1]) for f in feats]
        deep = getattr(out, "deepstack_features", None)
        if deep:  # Qwen3-VL: each image row carries its deepstack rows beside it, split again at the splice
            per_image = [torch.cat([f, *(layer[i] for layer in deep)], -1) for i, f in enumerate(per_image)]
        # one entry per image, or per request (Idefics3: per batch row, its images' tiles together; the
        # two agree when every request has one image)
        per_request = len(per_image) == len(group)
        at = 0
        for r in group:
            count = 1 if per_request else len(r.inputs.hashes)
            embeds = torch.cat(per_image[at : at + count])
            at += count
            if embeds.shape[0] != len(r.rows):
                raise ValueError(
                    f"the images give {embeds.shape[0]} embeddings for {len(r.rows)} image tokens in the prompt"
                )
            r.embeds = embeds


def splice(
    tower: VisionTower,
    ordered: list,
    input_ids: torch.Tensor,
    embedding: torch.nn.Module,
) -> tuple[torch.Tensor | None, dict]:
    """The step's input embeddings with each image token's row replaced by its image embedding (None
    when no scheduled chunk reaches an image token: the forward then takes token ids), and the text
    model's deepstack inputs where the encoder has them (Qwen3-VL: rows added to the first layers' hidden
    states at the image tokens). Embeddings a request will not need again (every sequence past its last
    image token after this step) are dropped."""
    reached = []  # (request images, query offset, first position, count, request)
    scheduled, q_off = {}, 0
    for seq, n in ordered:
        images = seq.request.images
        start = seq.num_computed_tokens
        scheduled[seq.seq_id] = start + n
        if images is not None and start <= images.last_row and start + n > images.first_row:
            reached.append((images, q_off, start, n, seq.request))
        q_off += n
    if not reached:
        return None, {}
    leader = tower.tp is None or tower.tp.rank == 0  # the rank that runs the encoder
    if leader:
        tower.encode(list({id(r[0]): r[0] for r in reached if r[0].embeds is None}.values()))
    embeds = embedding(input_ids)
    at, parts = [], []
    for images, offset, start, n, _ in reached:
        lo, hi = bisect_left(images.rows, start), bisect_left(images.rows, start + n)
        at.extend(offset + pos - start for pos in images.rows[lo:hi])
        if leader:
            parts.append(images.embeds[lo:hi])
    extra = {}
    if at:  # a chunk between two runs of an image (Idefics3's framing tokens) has none
        index = torch.tensor(at, dtype=torch.long, device=embeds.device)
        rows = _image_rows(tower, parts, len(at), embeds)
        width = embeds.shape[-1]
        embeds = embeds.index_copy(0, index, rows[:, :width])
        if rows.shape[1] > width:  # `at` ascends, as the model's boolean mask reads the rows
            mask = torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
            extra = {"visual_pos_masks": mask.index_fill(0, index, True)[None]}
            extra["deepstack_visual_embeds"] = list(rows[:, width:].split(width, dim=1))
    for images, *_, request in reached:
        if all(scheduled.get(s.seq_id, s.num_computed_tokens) > images.last_row for s in request.seqs):
            images.embeds = None
    return embeds, extra


def _image_rows(tower: VisionTower, parts: list, count: int, embeds: torch.Tensor) -> torch.Tensor:
    """The step's `count` image rows in splice order: rank 0's encoded `parts`, sent to the other ranks of
    a tensor-parallel group in one broadcast; a follower's, received from it (a follower knows `count`
    from the step plan: plan_codec.ImagesStandIn)."""
    if tower.tp is not None and tower.tp.rank:
        rows = torch.empty(count, tower.row_width(embeds.shape[-1]), dtype=embeds.dtype, device=embeds.device)
        return tower.tp.broadcast(rows)
    rows = torch.cat(parts).to(embeds.device, embeds.dtype)
    return rows if tower.tp is None else tower.tp.broadcast(rows.contiguous())


def is_vision_model(path: str) -> bool:
    """Whether the checkpoint at `path` is a vision-language model (its config has a vision tower)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path, local_files_only=True)
    return getattr(config, "vision_config", None) is not None


def check_vision_families(path: str) -> None:
    """ValueError naming a vision-language family bulkgen does not run, before any weight is read."""
    from transformers import AutoConfig

    for name in AutoConfig.from_pretrained(path, local_files_only=True).architectures or []:
        _check_name(name)


def load_vision(path: str, device, dtype: torch.dtype, config=None) -> tuple[torch.nn.Module, VisionTower]:
    """(the language half, the encoder with the processor) of the vision-language model at `path`;
    ValueError naming a family bulkgen does not run, before any weight is read. `config` (EngineConfig):
    its `quantize` quantizes as a text model is (loading.load_model): only the text model's decoder
    layers, online or by the checkpoint. One process's: with tensor_parallel > 1 the engine launches the
    ranks (tensor_parallel.launch; the language half is rank 0's shard, the encoder runs on rank 0 alone:
    vision_shards.py)."""
    from bulkgen.engine.model.loading import load_model

    check_vision_families(path)
    vlm = load_model(path, device, dtype, None if config is None else config.quantize, vision=True)
    tower = VisionTower(vlm, load_processor(path))
    return text_model(vlm), tower


def load_processor(path: str):
    """The processor of the vision-language model at `path`, as serving, `bulkgen plan` and the tests
    prepare its prompts: transformers' AutoProcessor, except where torchvision is missing: then bulkgen's
    mirror of Pixtral's processor (Mistral 3: transformers cannot import its own; pixtral.py), and the
    checkpoint's own processor without its video processor for a family that has one (Qwen-VL, SmolVLM:
    image_only.py). Its chat template, where only the processor has one, becomes its tokenizer's too: prompts
    are rendered through the tokenizer (the engine's, and the plan's for a vision model)."""
    from transformers import AutoProcessor

    from bulkgen.engine.features.image_only import load_image_only
    from bulkgen.engine.features.pixtral import load_mirror

    processor = (
        load_mirror(path)
        or load_image_only(path)
        or AutoProcessor.from_pretrained(path, local_files_only=True)
    )
    tokenizer = getattr(processor, "tokenizer", None)
    if tokenizer is not None and not tokenizer.chat_template:  # prompts are rendered through the tokenizer
        tokenizer.chat_template = getattr(processor, "chat_template", None)
    return processor


def mrope_positions(ordered: list, positions: torch.Tensor) -> torch.Tensor:
    """[3, 1, T] M-RoPE positions of a packed step from its 1-D `positions` [T]: p on all three axes,
    except in the rows of a prompt with images, which take its own table, then p + delta after it."""
    at, parts, q_off = [], [], 0
    for seq, n in ordered:
        images = seq.request.images
        if images is not None and images.mrope is not None:
            parts.append(images.mrope_rows(seq.num_computed_tokens, n))
            at.extend(range(q_off, q_off + n))
        q_off += n
    out = positions.expand(3, -1)
    if parts:  # one upload for every image prompt's rows
        index = torch.tensor(at, dtype=torch.long).to(positions.device)
        out = out.index_copy(1, index, torch.cat(parts, 1).to(positions.device, positions.dtype))
    return out[:, None]
