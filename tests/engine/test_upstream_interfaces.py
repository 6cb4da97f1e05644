"""bulkgen's imitations of transformers objects against what the installed transformers asks of them.

bulkgen hands transformers objects of its own: state views in place of a cache for hybrid layers
(hybrid_layers), and an attention function registered through `AttentionInterface` (attention,
layer_attention). A release that calls a new cache method or passes a new attention keyword would
otherwise break a model at its first step (transformers 5.25 did: `get_recurrent_states_to_keep`,
`increase_count`). These tests read the installed release's modeling code, so the next such change
fails here, naming the method or keyword, on the lock's release, the lower bound's and the canary's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import logging
from pathlib import Path

import pytest
import torch
import transformers
from transformers.cache_utils import Cache

from bulkgen.engine.attention.layer_attention import ATTENTION_KWARGS, probe_layers
from bulkgen.engine.features import hybrid_layers
from bulkgen.engine.model import upstream
from bulkgen.lab.tiny import ARCHITECTURES, build_tiny_model
from bulkgen.lab.tiny_hybrid import HYBRID_ARCHITECTURES, build_tiny_hybrid

pytestmark = pytest.mark.upstream  # also on the lower bound and the canary (README: tested ranges)


def _modeling_module(arch: str):
    """The transformers module holding an architecture's model class (tiny.ARCHITECTURES' entry)."""
    return importlib.import_module(getattr(transformers, ARCHITECTURES[arch][1]).__module__)


def _mixer_class(module) -> type:
    found = [
        obj
        for name, obj in vars(module).items()
        if inspect.isclass(obj) and name in hybrid_layers.CHECKED_MIXERS and obj.__module__ == module.__name__
    ]
    assert len(found) == 1, f"{module.__name__}: no single checked mixer class ({found})"
    return found[0]


def _cache_members(module, mixer: type) -> set[str]:
    """Every member the mixer's code reads of its cache argument (`cache.X`, `cache.layers[i].X`): in the
    mixer class and the module's functions (its conv and scan helpers); other classes (attention, the
    model) never see a state view."""
    tree = ast.parse(inspect.getsource(module))
    scopes = [
        node
        for node in tree.body
        if isinstance(node, ast.FunctionDef)
        or (isinstance(node, ast.ClassDef) and node.name == mixer.__name__)
    ]
    members = set()
    for scope in scopes:
        for node in ast.walk(scope):
            if not isinstance(node, ast.Attribute):
                continue
            base = node.value
            if isinstance(base, ast.Subscript) and isinstance(base.value, ast.Attribute):
                if base.value.attr == "layers":  # cache.layers[i].X (transformers 5.17)
                    base = base.value.value
            if isinstance(base, ast.Name) and base.id in hybrid_layers.CACHE_ARGS:
                members.add(node.attr)
    return members


def _views():
    state = torch.zeros(1, 2, 4)
    return [hybrid_layers._Probe(), hybrid_layers._SlotView([state], [state], True)]


@pytest.mark.parametrize("arch", sorted(HYBRID_ARCHITECTURES))
def test_state_views_answer_every_cache_member_the_mixer_reads(arch):
    module = _modeling_module(arch)
    mixer = _mixer_class(module)
    members = _cache_members(module, mixer)
    assert members, f"{mixer.__name__} reads nothing of its cache: the scan lost it"
    for view in _views():
        missing = sorted(m for m in members if m not in dir(view))
        assert not missing, (
            f"transformers {transformers.__version__}'s {mixer.__name__} reads {missing} of its cache, "
            f"which bulkgen's {type(view).__name__} lacks (bulkgen/engine/features/hybrid_layers.py)"
        )


@pytest.mark.parametrize("view", _views(), ids=lambda v: type(v).__name__)
def test_state_view_methods_take_what_transformers_cache_methods_take(view):
    """Each cache method the views answer takes every parameter transformers' `Cache` method of that name
    takes, by name, so a mixer calling it with keywords reaches the view's code."""
    checked = 0
    for name in dir(view):
        ours, theirs = getattr(type(view), name, None), getattr(Cache, name, None)
        if name.startswith("_") or not callable(ours) or not callable(theirs):
            continue
        params = inspect.signature(ours).parameters
        takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        wanted = [p for p in inspect.signature(theirs).parameters if p != "self" and p != "kwargs"]
        missing = [p for p in wanted if p not in params and not takes_any]
        assert not missing, f"{type(view).__name__}.{name} does not take {missing} as Cache.{name} does"
        checked += 1
    assert checked, "no cache method of the views is one of transformers' Cache: nothing compared"


def test_a_cache_member_the_views_lack_is_named_with_the_tested_range():
    with pytest.raises(AttributeError, match="has no 'some_new_method'.*transformers"):
        hybrid_layers._SlotView([], [], False).some_new_method(0)


def test_a_mixer_asking_for_a_member_the_views_lack_is_refused_at_load(tmp_path, monkeypatch):
    """A release whose mixer calls a new cache method: the engine's load refuses the model naming it, rather
    than a batch failing at its first step (as 5.25 failed every hybrid)."""
    from bulkgen.engine import Engine

    path = build_tiny_hybrid(tmp_path / "lfm2", "lfm2", seed=1)
    # a member every release's short conv calls (5.25's new `increase_count` only on 5.25 and later)
    monkeypatch.delattr(hybrid_layers._SlotView, "update_conv_state")
    with pytest.raises(upstream.UpstreamMismatch, match="Lfm2ShortConv.*update_conv_state.*transformers"):
        Engine.from_pretrained(str(path), device="cpu")


def _attention_keywords(module) -> set[str]:
    tree = ast.parse(inspect.getsource(module))
    return {
        kw.arg
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "attention_interface"
        for kw in node.keywords
        if kw.arg is not None
    }


def test_every_attention_keyword_of_the_matrix_is_known():
    """The keywords transformers' modeling code passes to the attention implementation, across the
    architecture matrix, are each in layer_attention.ATTENTION_KWARGS (read, or ignored for a reason)."""
    unknown = {}
    for arch in sorted(ARCHITECTURES):
        for keyword in _attention_keywords(_modeling_module(arch)) - ATTENTION_KWARGS.keys():
            unknown.setdefault(keyword, []).append(arch)
    assert not unknown, (
        f"transformers {transformers.__version__} passes attention keywords bulkgen does not know: {unknown}"
    )


def test_an_unknown_attention_keyword_is_said_at_load(tmp_path, caplog):
    """A layer handing its attention a keyword bulkgen does not know (a release renaming `s_aux`, say) is
    said at load, naming it and the tested range."""
    model = transformers.AutoModelForCausalLM.from_pretrained(build_tiny_model(tmp_path / "m", "llama"))
    attn = model.model.layers[0].self_attn
    forward = attn.forward
    attn.forward = lambda *a, **kw: forward(*a, **kw, sinks=torch.zeros(1))
    with caplog.at_level(logging.WARNING, logger="bulkgen.engine.attention.layer_attention"):
        probe_layers(model)
    assert "passes sinks to its attention" in caplog.text
    assert "transformers" in caplog.text


def test_tested_range_comes_from_the_package_metadata():
    """The range said in refusals is the one pyproject.toml declares (the installed package's metadata)."""
    spec = upstream.tested_range("transformers")
    assert spec is not None and "<=" in spec and ">=" in spec, spec
    assert upstream.within_tested("transformers") in (True, False)


def _transformers_names() -> dict[str, set[str]]:
    """Every `from transformers... import NAME` in bulkgen (module level or inside a function, where a
    missing name would surface only when that code runs): module -> names."""
    import bulkgen

    root = Path(bulkgen.__file__).parent
    names: dict[str, set[str]] = {}
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "transformers":
                names.setdefault(node.module, set()).update(a.name for a in node.names)
    return names


# private attributes bulkgen sets or reads on transformers modules: renamed, a setting would go unheard
# (hub_kernels' flag is what keeps transformers from fetching kernels at load)
PRIVATE_ATTRIBUTES = [("transformers.integrations.hub_kernels", "_kernels_enabled")]


def test_every_transformers_name_bulkgen_imports_exists():
    names = _transformers_names()
    assert "transformers.conversion_mapping" in names and "transformers.integrations.mxfp4" in names
    missing = []
    for module, wanted in sorted(names.items()):
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:
            missing.append(f"{module} ({exc})")
            continue
        missing += [f"{module}.{name}" for name in sorted(wanted) if not hasattr(mod, name)]
    for module, attr in PRIVATE_ATTRIBUTES:
        if not hasattr(importlib.import_module(module), attr):
            missing.append(f"{module}.{attr}")
    assert not missing, f"transformers {transformers.__version__} lacks what bulkgen imports: {missing}"
