"""Served LoRA adapters without a service: the `--lora` flag's forms, how an adapter finds its base (and the
start-up error when none fits), the adapters file re-read on change, and what validation makes of a line's
`model` in a batch of a base with adapters."""

from __future__ import annotations

import io
import json
import os

import pytest
from click.testing import CliRunner

from bulkgen.batch.validate import Validator, validate_stream
from bulkgen.cli import cli
from bulkgen.models.loras import AdapterCatalog, AdapterError, LoraSpec, parse_lora_specs
from bulkgen.settings_flags import from_flags

MODELS = {"base": "/models/base", "other": "/models/other"}


def adapter(tmp_path, name: str, base: str | None) -> str:
    folder = tmp_path / name
    folder.mkdir()
    config = {"peft_type": "LORA", "r": 4} | ({"base_model_name_or_path": base} if base else {})
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return str(folder)


def test_flag_forms_and_their_errors():
    specs = parse_lora_specs(["a=/x/a", "b = s3://bucket/adapters/b/ @ base"])
    assert specs == {"a": LoraSpec("a", "/x/a"), "b": LoraSpec("b", "s3://bucket/adapters/b/", "base")}
    for bad, why in [("noequals", "expected NAME=PATH"), ("a=/x@", "expected NAME=PATH")]:
        with pytest.raises(AdapterError, match=why):
            parse_lora_specs([bad])
    with pytest.raises(AdapterError, match="'a' is given twice"):
        parse_lora_specs(["a=/x", "a=/y"])
    with pytest.raises(ValueError, match="--lora 'x': expected NAME=PATH"):
        from_flags({"loras": ("x",)})


def test_the_base_comes_from_the_flag_the_config_or_the_only_model(tmp_path):
    by_name = adapter(tmp_path, "by-name", "other")
    by_path = adapter(tmp_path, "by-path", "/models/base/")
    foreign = adapter(tmp_path, "foreign", "meta-llama/Llama-3-8B")
    catalog = AdapterCatalog(parse_lora_specs([f"n={by_name}", f"p={by_path}", f"f={foreign}@other"]), MODELS)
    assert {a.name: a.base for a in catalog.adapters().values()} == {"n": "other", "p": "base", "f": "other"}
    assert catalog.of_base("other") == {"n": by_name, "f": foreign}
    only = AdapterCatalog(parse_lora_specs([f"f={foreign}"]), {"base": "/models/base"})
    assert only.adapters()["f"].base == "base"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("f={foreign}", "names base 'meta-llama/Llama-3-8B', which is none of the served models .* write f="),
        ("f={foreign}@nope", "no served model is named 'nope'"),
        ("base={by_name}", "'base' is already a served model's name"),
        ("m={missing}", "--lora m=.*missing.*No such file"),
    ],
)
def test_an_adapter_that_cannot_be_served_stops_the_start(tmp_path, spec, message):
    paths = {
        "foreign": adapter(tmp_path, "foreign", "meta-llama/Llama-3-8B"),
        "by_name": adapter(tmp_path, "by-name", "other"),
        "missing": str(tmp_path / "missing"),
    }
    with pytest.raises(AdapterError, match=message):
        AdapterCatalog(parse_lora_specs([spec.format(**paths)]), MODELS)


def test_run_names_the_bad_flag_in_one_line(tmp_path):
    result = CliRunner().invoke(
        cli,
        ["run", os.devnull, "-o", str(tmp_path / "o.jsonl"), "--storage", str(tmp_path / "s")]
        + ["--lora", f"x={tmp_path / 'none'}"],
    )
    assert result.exit_code == 1, result.output
    assert "--lora x=" in result.output and "Traceback" not in result.output


def test_the_adapters_file_is_read_again_when_it_changes(tmp_path, caplog):
    listed = tmp_path / "adapters.txt"
    listed.write_text("")
    catalog = AdapterCatalog({}, MODELS, str(listed))
    assert catalog.adapters() == {}
    first, second = adapter(tmp_path, "first", "base"), adapter(tmp_path, "second", "other")
    listed.write_text(f"# comment\none={first}\n\nbroken line\ntwo={second}\n")
    assert {a.name: a.base for a in catalog.adapters().values()} == {"one": "base", "two": "other"}
    assert f"{listed}:4: 'broken line'" in caplog.text  # a bad entry is skipped, named once
    listed.write_text(f"two={second}\n")
    assert list(catalog.adapters()) == ["two"]
    with pytest.raises(AdapterError, match="no such file"):
        AdapterCatalog({}, MODELS, str(tmp_path / "absent.txt"))


def line(custom_id: str, model: str) -> str:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    return json.dumps({"custom_id": custom_id, "url": "/v1/completions", "body": body})


def validate(models: list[str], adapters: dict[str, str]):
    seen = {}
    text = "\n".join(line(f"r{i}", m) for i, m in enumerate(models)).encode()
    validator = Validator("/v1/completions", MODELS, 100, adapters)
    result = validate_stream(io.BytesIO(text), validator, lambda n, s, r, req: seen.update({n: req.lora}))
    return result, seen


def test_a_line_names_the_base_or_one_of_its_adapters_else_it_alone_is_refused():
    adapters = {"a1": "base", "a2": "base", "o1": "other"}
    result, loras = validate(["typo", "a1", "base", "a2", "o1", "typo"], adapters)
    assert result.ok and result.model == "base", result.errors
    assert loras == {1: None, 2: "a1", 3: None, 4: "a2", 5: None, 6: None}
    assert [(e["line"], e["code"], e["param"]) for e in result.refused] == [
        (1, "model_not_found", "body.model"),  # decided once line 2 named the base
        (5, "model_not_found", "body.model"),  # another base's adapter
        (6, "model_not_found", "body.model"),
    ]
    assert "neither the batch's model 'base' nor one of its adapters (a1, a2)" in result.refused[1]["message"]


def test_one_model_per_file_still_holds():
    adapters = {"a1": "base"}
    result, _ = validate(["a1", "other"], adapters)  # another served model fails the file
    assert [(e["line"], e["code"]) for e in result.errors] == [(2, "model_mismatch")]
    result, _ = validate(["other", "typo"], adapters)  # a base without adapters: an unknown name too
    assert [(e["line"], e["code"]) for e in result.errors] == [(2, "model_mismatch")]
    result, _ = validate(["typo", "typo"], adapters)  # no line names a served model
    assert [(e["line"], e["code"]) for e in result.errors] == [(1, "model_not_found")]


def test_lines_of_one_adapter_share_a_prefix_key_and_other_adapters_do_not():
    """The runtime's prefix affinity (workqueue) then keeps one adapter's lines on one worker, and never
    expects another adapter's lines to hit that worker's prefix cache."""
    from bulkgen.runtime.lineindex import IndexBuilder

    builder = IndexBuilder()
    for number, model in enumerate(["a1", "a1", "a2", "base"], start=1):
        raw = line(f"r{number}", model).encode()
        builder.add(
            number,
            0,
            raw,
            Validator("/v1/completions", MODELS, 9, {"a1": "base", "a2": "base"}).feed(number, raw),
        )
    keys = builder.build().prefix.tolist()
    assert keys[0] == keys[1] and len({keys[1], keys[2], keys[3]}) == 3


def test_plan_takes_the_adapters_a_file_names(tmp_path):
    """Without --lora the sample's adapter lines are other models; with them the file is valid, so plan
    goes on to look for a profile of the device (none is stored for h200 here)."""
    from bulkgen.lab.tiny_lora import SAMPLE_ADAPTERS, SAMPLES_DIR

    args = ["plan", str(SAMPLES_DIR.parent / "lora.jsonl"), "--storage", str(tmp_path), "--gpu", "h200"]
    result = CliRunner().invoke(cli, [*args, "--json"])
    assert result.exit_code == 1 and "model_mismatch" in result.output, result.output
    flags = [f"--lora={name}={SAMPLES_DIR / name}@bulkgen-tiny" for name in SAMPLE_ADAPTERS]
    result = CliRunner().invoke(cli, [*args, *flags])
    assert result.exit_code == 1 and "no profile of bulkgen-tiny exists" in result.output, result.output


def test_a_watch_job_declares_its_adapters_and_a_bad_one_stops_it(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"input: {tmp_path / 'in'}\noutput: {tmp_path / 'out'}\nloras: [x={tmp_path / 'none'}]\n")
    args = ["watch", "--job", str(job), "--storage", str(tmp_path / "s"), "--once"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 1 and f"--lora x={tmp_path / 'none'}" in result.output, result.output
    job.write_text(f"input: {tmp_path / 'in'}\noutput: {tmp_path / 'out'}\nloras: x=/a\n")
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and "loras must be a list of NAME=PATH[@BASE] strings" in result.output


def test_an_adapter_scoped_to_tenants_is_served_to_them_alone(tmp_path):
    """`tenants=T1,T2` after a flag or a file line scopes the adapter; without it the adapter is global; the
    runtime (tenant None) sees every adapter."""
    a, b, c = (adapter(tmp_path, name, "base") for name in ("a", "b", "c"))
    assert parse_lora_specs([f"a={a} tenants=acme,globex"])["a"] == LoraSpec(
        "a", a, None, frozenset({"acme", "globex"})
    )
    listed = tmp_path / "adapters.txt"
    listed.write_text(f"b={b}@base tenants=globex\nc={c}\n")
    catalog = AdapterCatalog(parse_lora_specs([f"a={a} tenants=acme"]), MODELS, str(listed))
    assert sorted(catalog.adapters("acme")) == ["a", "c"]
    assert sorted(catalog.adapters("globex")) == ["b", "c"]
    assert sorted(catalog.adapters("default")) == ["c"]
    assert sorted(catalog.adapters()) == ["a", "b", "c"]
    assert catalog.of_base("base", "acme") == {"a": a, "c": c}
    for bad, why in [(f"a={a} tenants=", "names no tenant"), (f"a={a} tenants=Bad!", "tenant name 'Bad!'")]:
        with pytest.raises(AdapterError, match=why):
            parse_lora_specs([bad])
