"""Broken checkpoints and adapters are refused at load, with one line naming the file and the tensor, instead
of serving garbage or escaping as an engine error: each case below is a real tiny checkpoint or adapter
with one thing broken (a scale deleted, NaN or inf written into a scale, an all-NaN adapter, garbage bytes,
a 2^40 header length, a 0-d lora_A). Tensor-parallel loads run the same checker:
test_tensor_parallel_fp8_checkpoints.py's test_an_fp8_weight_without_its_scales_is_refused_naming_it."""

from __future__ import annotations

import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from bulkgen.engine import Engine
from bulkgen.engine.features.lora import WEIGHTS_FILE
from bulkgen.engine.model.checkpoint_checks import CheckpointError
from bulkgen.lab.quantized import write_block_fp8, write_compressed_fp8
from bulkgen.lab.tiny import build_tiny_model
from bulkgen.lab.tiny_lora import save_random_adapter

pytestmark = pytest.mark.upstream  # transformers' quantizers and peft's files (README: tested ranges)

LAYER = "model.layers.0.mlp.up_proj"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("float") / "llama", arch="llama", seed=1)


@pytest.fixture(scope="module")
def checkpoints(tiny, tmp_path_factory):
    root = tmp_path_factory.mktemp("quantized")
    return {
        "fp8": write_block_fp8(tiny, root / "block", block=32),
        "compressed-tensors": write_compressed_fp8(tiny, root / "ct", "channel"),
    }


SCALE = {"fp8": f"{LAYER}.weight_scale_inv", "compressed-tensors": f"{LAYER}.weight_scale"}


def _broken_copy(src, dst, edit):
    """A copy of the checkpoint folder `src` whose model.safetensors went through `edit(tensors)`."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    edit(tensors)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _load(path) -> Engine:
    return Engine.from_pretrained(str(path), device="cpu", max_num_seqs=2, block_size=8)


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
def test_a_quantized_weight_without_its_scale_is_refused(method, checkpoints, tmp_path):
    path = _broken_copy(checkpoints[method], tmp_path / "broken", lambda t: t.pop(SCALE[method]))
    with pytest.raises(CheckpointError) as refused:
        _load(path)
    message = str(refused.value)
    assert "model.safetensors" in message and f"{LAYER}.weight" in message and SCALE[method] in message
    assert "\n" not in message and str(tmp_path) not in message  # one line, no server path


@pytest.mark.parametrize("method", ["fp8", "compressed-tensors"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_scale_is_refused(method, bad, checkpoints, tmp_path):
    def poison(tensors):
        tensors[SCALE[method]].view(-1)[0] = bad

    path = _broken_copy(checkpoints[method], tmp_path / "broken", poison)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: {SCALE[method]} .*(nan|inf)"):
        _load(path)


def test_sound_quantized_checkpoints_still_load(checkpoints):
    for path in checkpoints.values():
        assert _load(path).generate([[1, 2, 3]], None)


# -- adapters ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(tiny):
    return Engine.from_pretrained(str(tiny), device="cpu", max_num_seqs=2, block_size=8)


@pytest.fixture
def adapter(tiny, tmp_path):
    return save_random_adapter(tiny, tmp_path / "adapter", 3, 4, 8, ("q_proj", "v_proj"))


def _edit_adapter(folder, edit):
    tensors = load_file(str(folder / WEIGHTS_FILE))
    edit(tensors)
    save_file(tensors, str(folder / WEIGHTS_FILE))


A_KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


def _refused(engine, folder, pattern: str) -> str:
    try:
        with pytest.raises(CheckpointError, match=pattern) as refused:
            engine.add_lora("broken", folder)
    finally:  # the module's engine stays clean for the next case, whatever this one did
        if "broken" in engine.loras():
            engine.remove_lora("broken")
    message = str(refused.value)
    assert "'broken'" in message and WEIGHTS_FILE in message, message
    assert "\n" not in message and str(folder) not in message, message  # one line, no server path
    assert "broken" not in engine.loras()
    return message


def test_an_all_nan_adapter_is_refused(engine, adapter):
    _edit_adapter(adapter, lambda t: [x.fill_(float("nan")) for x in t.values()])
    _refused(engine, adapter, r"lora_A\.weight .*nan")


def test_a_garbage_adapter_file_is_refused(engine, adapter):
    (adapter / WEIGHTS_FILE).write_bytes(bytes(range(256)) * 16)
    _refused(engine, adapter, "not a safetensors file")


def test_an_absurd_header_length_is_refused(engine, adapter):
    (adapter / WEIGHTS_FILE).write_bytes(struct.pack("<Q", 2**40) + b'{"a": 1}')
    _refused(engine, adapter, "header of 1099511627776 bytes")


def test_a_zero_dimensional_lora_a_is_refused(engine, adapter):
    def flatten(tensors):
        tensors[A_KEY] = torch.tensor(1.0)

    _edit_adapter(adapter, flatten)
    _refused(engine, adapter, r"q_proj\.lora_A\.weight has shape \[\]")


def test_a_lora_of_other_dims_is_refused(engine, adapter):
    def widen(tensors):
        tensors[A_KEY] = torch.ones(4, 65)

    _edit_adapter(adapter, widen)
    with pytest.raises(ValueError, match=r"q_proj is 64 -> 64 in the model, but its LoRA is 65 -> 64"):
        engine.add_lora("broken", adapter)


def test_a_sound_adapter_still_loads(engine, adapter):
    engine.add_lora("sound", adapter)
    assert "sound" in engine.loras()
    engine.remove_lora("sound")


def test_an_mxfp4_block_without_its_scales_is_refused(tmp_path):
    """gpt-oss' layout: each `*_blocks` tensor needs its `*_scales` (checked from the header alone)."""
    from bulkgen.engine.model.checkpoint_checks import check_checkpoint

    name = "model.layers.0.mlp.experts.down_proj"
    blocks = {f"{name}_blocks": torch.zeros(2, 4, 1, 16, dtype=torch.uint8)}
    save_file(
        {**blocks, f"{name}_scales": torch.zeros(2, 4, 1, dtype=torch.uint8)}, str(tmp_path / "a.safetensors")
    )
    check_checkpoint(tmp_path, {"quant_method": "mxfp4"})
    save_file(blocks, str(tmp_path / "a.safetensors"))
    with pytest.raises(
        CheckpointError, match=rf"a\.safetensors: {name}_blocks is U8 but its scale {name}_scales"
    ):
        check_checkpoint(tmp_path, {"quant_method": "mxfp4"})
