"""Tiny random PEFT LoRA adapters, seeded, for a model folder: the adapters of `samples/lora.jsonl` and of
the service's LoRA tests. Nothing is downloaded; the same seed writes the same bytes.

PEFT starts B at zero (an adapter that changes nothing until trained); these start A and B at random, so
each adapter's tokens differ from the base model's and from each other's, which is what the tests check.

    python -m bulkgen.lab.tiny_lora   # writes samples/lora/{terse,chatty,formal,pirate} for bulkgen-tiny
"""

from __future__ import annotations

import json
from pathlib import Path

from bulkgen.models.loras import ADAPTER_CONFIG
from bulkgen.models.registry import DEFAULT_MODEL_NAME, default_model_path

# name -> (seed, rank, lora_alpha, target modules): different ranks and targets, as users' adapters come
SAMPLE_ADAPTERS = {
    "terse": (1, 4, 8, ("q_proj", "v_proj")),
    "chatty": (2, 8, 16, ("q_proj", "k_proj", "v_proj", "o_proj")),
    "formal": (3, 8, 16, ("gate_proj", "up_proj", "down_proj")),
    "pirate": (4, 2, 4, ("q_proj", "v_proj", "down_proj")),
}
SAMPLES_DIR = Path(__file__).resolve().parents[2] / "samples" / "lora"


def save_random_adapter(
    base_path: str | Path,
    out: str | Path,
    seed: int,
    rank: int,
    alpha: int,
    targets: tuple[str, ...],
    base_name: str | None = None,
) -> Path:
    """A PEFT folder (adapter_config.json + adapter_model.safetensors) of random A and B for the model at
    `base_path`; its config names `base_name` (a served model's name) as its base, else the path."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(base_path), dtype=torch.float32)
    torch.manual_seed(seed)
    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, lora_dropout=0.0
    )
    out = Path(out)
    get_peft_model(base, config).save_pretrained(str(out))
    (out / "README.md").unlink(missing_ok=True)  # PEFT's empty model card
    # rewritten after saving: PEFT would look a base name up on the hub while saving, and writes its targets
    # in set order (the same seed must write the same bytes)
    saved = json.loads((out / ADAPTER_CONFIG).read_text())
    saved["base_model_name_or_path"] = base_name or str(base_path)
    saved["target_modules"] = sorted(saved["target_modules"])
    (out / ADAPTER_CONFIG).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return out


def write_samples(root: Path = SAMPLES_DIR) -> list[Path]:
    """The sample adapters of the bundled model, as samples/lora.jsonl names them."""
    return [
        save_random_adapter(default_model_path(), root / name, *spec, base_name=DEFAULT_MODEL_NAME)
        for name, spec in SAMPLE_ADAPTERS.items()
    ]


if __name__ == "__main__":
    for path in write_samples():
        print(path)
