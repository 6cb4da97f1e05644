"""Settings from the command line: every flag of the settings' fields (`flag_fields`, which
`bulkgen.cli.settings_options` makes click options of) and the Settings built back from what a user typed
(`from_flags`), each value in its field's terms and checked by its field."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, fields, is_dataclass
from typing import Any

from bulkgen.settings import Flag, SettingError, Settings


@dataclass(frozen=True)
class FlagField:
    """One flag and where its value goes: `path` from Settings, e.g. ("workers", "engine_kwargs", "max_num_seqs")."""

    path: tuple[str, ...]
    flag: Flag
    default: Any  # in the flag's unit; None for a repeatable flag (its parser makes the field's default)

    @property
    def param(self) -> str:
        """The command's parameter name: the field's (or dict key's) own name, unique across the settings."""
        return self.path[-1]


def flag_fields(cls: type = Settings, path: tuple[str, ...] = ()) -> Iterator[FlagField]:
    """Every flag of the settings, in field order (nested settings where their field stands)."""
    for item in fields(cls):
        where, meta = (*path, item.name), item.metadata
        if is_dataclass(item.default_factory):
            yield from flag_fields(item.default_factory, where)
        for key, flag in (meta.get("keys") or {}).items():
            yield FlagField((*where, key), flag, None)
        if meta.get("flag") is not None:
            flag = meta["flag"]
            default = None if flag.parse or item.default is MISSING else item.default
            yield FlagField(where, flag, default // flag.scale if flag.scale != 1 else default)


def from_flags(values: Mapping[str, Any]) -> Settings:
    """Settings from command-line values keyed by `FlagField.param` (None or absent: the field's default);
    ValueError naming the flag and the value the user gave."""
    tree: dict[str, Any] = {}
    known = {item.param: item for item in flag_fields()}
    for name, item in known.items():
        raw = values.get(name)
        if raw is None:
            continue
        node = tree
        for step in item.path[:-1]:
            node = node.setdefault(step, {})
        node[item.param] = _in_field_terms(item.flag, raw)
    try:
        return _build(Settings, tree)
    except SettingError as exc:
        if exc.field not in known:
            raise
        flag, raw = known[exc.field].flag, values.get(exc.field)
        shown = (
            "" if flag.parse else f" {raw:g}" if isinstance(raw, float) else f" {raw!r}"
        )  # as typed: 0.3, 5
        raise ValueError(f"{flag.name}{shown}: {exc.message}") from None


def _in_field_terms(flag: Flag, raw: Any) -> Any:
    """A flag's value as its field holds it: a repeatable flag's values parsed, a unit scaled (MiB -> bytes)."""
    if flag.parse:
        return flag.parse(raw)
    return raw * flag.scale if flag.scale != 1 else raw


def _build(cls: type, tree: dict[str, Any]) -> Any:
    kinds = {item.name: item.default_factory for item in fields(cls)}
    return cls(
        **{
            name: _build(kinds[name], value) if is_dataclass(kinds[name]) else value
            for name, value in tree.items()
        }
    )
