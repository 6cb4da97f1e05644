"""The engine's prefill-only path: pooled vectors equal sentence-transformers' own `encode` (fp32, CPU)
for a tiny random decoder saved with a sentence-transformers pooling config (the layout of
sentence-transformers < 6, and folders saved by the installed sentence-transformers itself), chunked or
not, alone or packed with generation; `dimensions` only for matryoshka models; KV blocks freed at once;
a module bulkgen does not compute refuses embedding, named."""

from __future__ import annotations

import json

import pytest
import torch

from bulkgen.engine import EmbedParams, Engine, SamplingParams
from bulkgen.engine.features.pooling import EmbedError, PoolingConfig, load_pooling
from bulkgen.lab.tiny import add_sentence_transformers_config, build_tiny_model

# mixed lengths: 1 byte token to several chunks of the small budget below
TEXTS = [
    "a",
    "hello world",
    "an embedding of a medium sized sentence, " * 3,
    "z" * 90,
    "long " * 60,
    "é✓ unicode",
]


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory):
    """Build one sentence-transformers folder per (pooling, normalize) on first use."""
    root = tmp_path_factory.mktemp("st")
    made = {}

    def make(pooling: str, normalize: bool, **st_config):
        key = (pooling, normalize, tuple(sorted(st_config.items())))
        if key not in made:
            path = build_tiny_model(root / f"{pooling}-{normalize}-{len(made)}", seed=5)
            made[key] = add_sentence_transformers_config(path, pooling, normalize, **st_config)
        return made[key]

    return make


def st_encode(path, texts) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(str(path), device="cpu").encode(texts, batch_size=4))


@pytest.mark.parametrize("pooling", ["lasttoken", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_vectors_equal_sentence_transformers(st_folder, pooling, normalize):
    path = st_folder(pooling, normalize)
    reference = st_encode(path, TEXTS)
    for budget in (2048, 32):  # 32 tokens per step: the long inputs are computed in several chunks
        engine = Engine.from_pretrained(str(path), max_num_batched_tokens=budget, max_num_seqs=4)
        got = torch.tensor(engine.embed(TEXTS))
        cosine = torch.nn.functional.cosine_similarity(got, reference)
        assert cosine.min() >= 0.9999, (budget, cosine)
        assert torch.allclose(got.norm(dim=1), reference.norm(dim=1), rtol=1e-4), budget  # magnitudes too
        assert engine.block_manager.num_free_blocks == engine.runner.num_blocks  # every block freed


def _st_saved(folder, target):
    """The folder loaded and saved again by the installed sentence-transformers: its own module types
    (`sentence_transformers.sentence_transformer.modules.pooling.Pooling`, ...) and module configs."""
    from sentence_transformers import SentenceTransformer

    SentenceTransformer(str(folder), device="cpu").save(str(target))
    return target


@pytest.mark.parametrize("pooling", ["lasttoken", "mean", "cls"])
@pytest.mark.parametrize("normalize", [True, False])
def test_folders_saved_by_the_installed_sentence_transformers(st_folder, tmp_path, pooling, normalize):
    path = _st_saved(st_folder(pooling, normalize), tmp_path / "saved")
    types = [m["type"] for m in json.loads((path / "modules.json").read_text())]
    assert "sentence_transformers.models.Pooling" not in types  # the new spelling, not the old one
    reference = st_encode(path, TEXTS)
    got = torch.tensor(Engine.from_pretrained(str(path), max_num_batched_tokens=32).embed(TEXTS))
    assert torch.nn.functional.cosine_similarity(got, reference).min() >= 0.9999
    assert torch.allclose(got.norm(dim=1), reference.norm(dim=1), rtol=1e-4)  # normalised exactly when ST is


def test_a_model_built_with_sentence_transformers_modules(tmp_path):
    """Built from the installed package's own module classes, text-only, as its docs build a decoder embedder."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Normalize, Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf = build_tiny_model(tmp_path / "hf", seed=5)
    text_only = {"text": {"method": "forward", "method_output_name": "last_hidden_state"}}
    backbone = Transformer(str(hf), modality_config=text_only, module_output_name="token_embeddings")
    model = SentenceTransformer(modules=[backbone, Pooling(64, "lasttoken"), Normalize()], device="cpu")
    model.save(str(tmp_path / "st"))
    reference = torch.tensor(model.encode(TEXTS))
    got = torch.tensor(Engine.from_pretrained(str(tmp_path / "st")).embed(TEXTS))
    assert torch.nn.functional.cosine_similarity(got, reference).min() >= 0.9999
    assert torch.allclose(got.norm(dim=1), torch.ones(len(TEXTS)), atol=1e-5)


def test_a_chat_rendering_transformer_is_refused(tmp_path):
    """sentence-transformers 6 renders text through a tokenizer's chat template ('message' modality);
    bulkgen embeds the text as sent, so it refuses the model rather than return other vectors."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sentence_transformer.modules import Pooling

    hf = build_tiny_model(tmp_path / "hf", seed=5)
    SentenceTransformer(modules=[Transformer(str(hf)), Pooling(64, "mean")], device="cpu").save(
        str(tmp_path / "st")
    )
    with pytest.raises(ValueError, match="renders text through the chat template") as err:
        load_pooling(tmp_path / "st")
    assert "\n" not in str(err.value)
    with pytest.raises(EmbedError, match="chat template"):
        Engine.from_pretrained(str(tmp_path / "st")).add_request("r", "hi", EmbedParams())


@pytest.mark.parametrize(
    "module",
    [
        "sentence_transformers.base.modules.dense.Dense",
        "sentence_transformers.models.Dense",
        "sentence_transformers.base.modules.router.Router",
        "my_package.modules.Normalize",  # a class named Normalize, but not sentence-transformers' own
    ],
)
def test_an_unknown_module_type_is_refused_at_load_by_name(st_folder, tmp_path, caplog, module):
    path = _st_saved(st_folder("mean", False), tmp_path / "saved")
    modules = json.loads((path / "modules.json").read_text())
    modules.append({"idx": 2, "name": "2", "path": "2_Extra", "type": module})
    (path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match=f"module type '{module}' is not supported"):
        load_pooling(path)
    engine = Engine.from_pretrained(str(path))
    assert module in caplog.text  # said once at load
    with pytest.raises(EmbedError, match=module):
        engine.add_request("r", "hi", EmbedParams())


def test_the_default_rule_is_last_token_normalised(tmp_path, st_folder):
    bare = build_tiny_model(tmp_path / "bare", seed=5)
    assert load_pooling(bare) == PoolingConfig("last", True)
    with_st = st_encode(st_folder("lasttoken", True), TEXTS)
    got = torch.tensor(Engine.from_pretrained(str(bare)).embed(TEXTS))  # same weights, no ST folder
    assert torch.nn.functional.cosine_similarity(got, with_st).min() >= 0.9999


def test_embeddings_share_steps_with_generation(st_folder):
    """Packed into the same steps as prompts being generated: neither changes the other's result."""
    path = str(st_folder("mean", False))
    alone = Engine.from_pretrained(path, max_num_batched_tokens=48)
    greedy = SamplingParams(max_tokens=12, temperature=0)
    expected_text = [o.token_ids for o in alone.generate(TEXTS[:3], greedy)]
    expected_vec = torch.tensor(alone.embed(TEXTS))
    mixed = Engine.from_pretrained(path, max_num_batched_tokens=48)
    params = [greedy] * 3 + [EmbedParams()] * len(TEXTS)
    outs = mixed.generate(TEXTS[:3] + TEXTS, params)
    assert [o.token_ids for o in outs[:3]] == expected_text
    got = torch.tensor([o.embedding for o in outs[3:]])
    assert torch.nn.functional.cosine_similarity(got, expected_vec).min() >= 0.99999
    assert all(o.outputs == [] and o.metrics.num_output_tokens == 0 for o in outs[3:])


def test_mean_pooling_never_takes_a_cached_prefix(st_folder):
    """A cached prefix is never computed, so mean pooling would miss its rows: it computes them again."""
    engine = Engine.from_pretrained(str(st_folder("mean", False)))
    text = "a shared prefix that fills several KV blocks " * 4
    first = engine.embed([text])[0]
    again = engine.embed([text])[0]
    assert engine.requests == {} and first == pytest.approx(again, rel=1e-5)
    assert engine.stats()["cached_prompt_tokens"] == 0


def test_dimensions_only_for_matryoshka_models(st_folder):
    plain = Engine.from_pretrained(str(st_folder("lasttoken", True)))
    with pytest.raises(EmbedError, match="dimensions is not supported") as err:
        plain.add_request("r", "text", EmbedParams(dimensions=8))
    assert err.value.field == "dimensions" and plain.requests == {}
    matryoshka = Engine.from_pretrained(str(st_folder("lasttoken", True, matryoshka=True)))
    full = torch.tensor(matryoshka.embed(TEXTS))
    short = torch.tensor(matryoshka.embed(TEXTS, EmbedParams(dimensions=16)))
    assert short.shape == (len(TEXTS), 16)
    assert torch.allclose(
        short, torch.nn.functional.normalize(full[:, :16], dim=1), atol=1e-6
    )  # re-normalised
    with pytest.raises(EmbedError, match="at most 64"):
        matryoshka.add_request("r", "text", EmbedParams(dimensions=65))
    with pytest.raises(EmbedError, match="positive integer"):
        EmbedParams(dimensions=0)


def test_truncate_dim_is_the_default_size(st_folder):
    path = st_folder("mean", False, truncate_dim=24)
    got = torch.tensor(Engine.from_pretrained(str(path)).embed(TEXTS))
    reference = st_encode(path, TEXTS)  # sentence-transformers truncates to truncate_dim as well
    assert got.shape == reference.shape == (len(TEXTS), 24)
    assert torch.nn.functional.cosine_similarity(got, reference).min() >= 0.9999


def test_an_input_may_fill_the_context(tmp_path):
    engine = Engine.from_pretrained(str(build_tiny_model(tmp_path / "m", seed=5, max_position_embeddings=64)))
    assert len(engine.embed([list(range(64))])[0]) == 64
    with pytest.raises(ValueError, match="exceeds the context length"):
        engine.add_request("r", list(range(65)), EmbedParams())


@pytest.mark.parametrize(
    "config",
    [
        {"pooling_mode": "max"},
        {"pooling_mode": ["mean", "cls"]},
        {"pooling_mode_max_tokens": True},
        {"pooling_mode": "mean", "include_prompt": False},
    ],
)
def test_unsupported_pooling_is_refused_at_load(tmp_path, config):
    path = add_sentence_transformers_config(build_tiny_model(tmp_path / "m", seed=5), "mean", False)
    (path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="pooling .* is not supported"):
        load_pooling(path)
    engine = Engine.from_pretrained(str(path))  # the model still generates; only embedding is refused
    assert len(engine.generate(["hi"], SamplingParams(max_tokens=3, temperature=0))[0].token_ids) == 3
    with pytest.raises(EmbedError, match="this model cannot embed") as err:
        engine.add_request("r", "hi", EmbedParams())
    assert err.value.field == "model" and engine.requests == {}


def test_legacy_pooling_flags(tmp_path):
    path = add_sentence_transformers_config(build_tiny_model(tmp_path / "m", seed=5), "mean", True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert load_pooling(path) == PoolingConfig("last", True)
    (path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_cls_token": False}))
    assert load_pooling(path).method == "mean"  # no flag set: sentence-transformers' default


@pytest.mark.parametrize("pooling", ["lasttoken", "mean"])
def test_a_last_chunk_of_one_token(st_folder, pooling):
    """33 tokens at a 32-token budget: the last chunk is one token after cached context, which the runner
    plans like a decode; it is still pooled."""
    path = str(st_folder(pooling, True))
    ids = list(range(40, 73))
    whole = torch.tensor(Engine.from_pretrained(path).embed([ids]))
    chunked = torch.tensor(Engine.from_pretrained(path, max_num_batched_tokens=32).embed([ids]))
    assert torch.nn.functional.cosine_similarity(whole, chunked).item() >= 0.99999
