"""The engine's settings are one typed EngineConfig from the service's settings to the engine: an option that is
no setting is refused where it is given (a TypeError from the library, a SettingError from the service's
settings), never dropped on the way, and the service builds a worker's config in one place."""

from __future__ import annotations

import subprocess
import sys

import pytest

from bulkgen.engine import Engine, SamplingParams
from bulkgen.engine.config import EngineConfig
from bulkgen.settings import SettingError, WorkerSettings


def test_from_pretrained_takes_a_typed_config(model_dirs, reference):
    engine = Engine.from_pretrained(
        str(model_dirs["llama"]), EngineConfig(max_num_seqs=3, block_size=8), device="cpu"
    )
    assert (engine.config.max_num_seqs, engine.config.block_size) == (3, 8)
    assert engine.free_capacity()["max_num_seqs"] == 3
    out = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    assert out[0].outputs[0].token_ids == reference.greedy("llama", [5, 6, 7, 8], 4)


def test_keyword_fields_are_the_same_config(model_dirs):
    engine = Engine.from_pretrained(str(model_dirs["llama"]), device="cpu", max_num_seqs=5)
    assert engine.config.max_num_seqs == 5


def test_an_unknown_option_is_a_type_error_naming_it_before_loading(tmp_path):
    # tmp_path holds no checkpoint: the option is refused before anything is read
    with pytest.raises(TypeError, match="max_num_seq"):
        Engine.from_pretrained(str(tmp_path), device="cpu", max_num_seq=8)
    with pytest.raises(TypeError, match=r"not both: got config and \['block_size'\]"):
        Engine.from_pretrained(str(tmp_path), EngineConfig(), device="cpu", block_size=8)


def test_engine_takes_the_config_positionally_and_refuses_unknown_keywords(model_dirs, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
    with pytest.raises(TypeError, match="kv_blocks"):
        Engine(model, tokenizer, kv_blocks=4)
    engine = Engine(model, tokenizer, EngineConfig(num_kv_blocks=40, max_num_seqs=2))
    assert engine.runner.num_blocks == 40


def test_worker_settings_build_the_config_once_and_refuse_unknown_options():
    settings = WorkerSettings(engine_kwargs={"max_num_seqs": 8, "block_size": 32})
    config = settings.engine_config(2)
    assert isinstance(config, EngineConfig)
    assert (config.max_num_seqs, config.block_size, config.tensor_parallel) == (8, 32, 2)
    assert settings.engine_config().tensor_parallel == 1
    with pytest.raises(SettingError, match=r"^max_num_seq 8: is not an engine setting") as refused:
        WorkerSettings(engine_kwargs={"max_num_seq": 8})
    assert refused.value.field == "max_num_seq"
    # a field without a flag is checked by EngineConfig itself, naming it
    with pytest.raises(SettingError, match=r"^block_size 0: must be a positive int$") as refused:
        WorkerSettings(engine_kwargs={"block_size": 0})
    assert refused.value.field == "block_size"
    with pytest.raises(SettingError, match=r"^kv_cache_memory_fraction 'most': must be in \(0, 1\]$"):
        WorkerSettings(engine_kwargs={"kv_cache_memory_fraction": "most"})
    with pytest.raises(SettingError, match=r"^async_scheduling 'maybe': must be true, false or None"):
        WorkerSettings(engine_kwargs={"async_scheduling": "maybe"})


def test_the_config_imports_no_torch():
    """The service's settings build EngineConfig; the API process they run in must not load torch."""
    code = "import sys, bulkgen.engine.config, bulkgen.settings; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
