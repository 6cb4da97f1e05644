"""Click options made from the settings' fields (`bulkgen.settings.Flag`), and the Settings made back from
what the user typed: a flag's name, help, env var, default and check are written once, beside its field."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import click

from bulkgen.settings import Settings
from bulkgen.settings_flags import FlagField, flag_fields, from_flags

SETTING_PARAMS = tuple(item.param for item in flag_fields())


def _option(item: FlagField) -> Callable:
    flag = item.flag
    options: dict[str, Any] = {"help": flag.help, "envvar": flag.envvar, "metavar": flag.metavar}
    if flag.parse:
        options["multiple"] = True
    elif isinstance(item.default, bool):
        options["is_flag"] = True
    else:
        kind = flag.type or (str if item.default is None else type(item.default))
        options["type"] = click.Choice(flag.choices) if flag.choices else kind
        options["default"] = item.default
        options["show_default"] = item.default is not None
    return click.option(flag.name, item.param, **options)


def settings_flags(fn: Callable) -> Callable:
    """Every shared settings flag, in field order; the command builds Settings with `settings_from`."""
    for item in reversed([item for item in flag_fields() if item.flag.shared]):
        fn = _option(item)(fn)
    return fn


def setting_option(param: str) -> Callable:
    """The flag of one setting, for the command that alone uses it (e.g. serve's --refuse-infeasible)."""
    (item,) = [item for item in flag_fields() if item.param == param]
    return _option(item)


def override_flags(cls: type) -> Callable[[Callable], Callable]:
    """The flags of a definition's fields (a watch job's `Job`), made as the settings' are. Each
    defaults to None: only what the user typed overrides the definition (`pop_flags` takes the values)."""
    items = list(flag_fields(cls))
    clash = {item.param for item in items} & set(SETTING_PARAMS)
    if clash:  # one keyword argument per name: a clash would silently drop one of the two
        raise TypeError(f"{cls.__name__} flags {sorted(clash)} share a name with settings flags")

    def decorate(fn: Callable) -> Callable:
        for item in reversed(items):
            fn = _option(FlagField(item.path, item.flag, None))(fn)
        return fn

    return decorate


def pop_flags(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the values of `override_flags(cls)` out of a command's keyword arguments."""
    return {item.param: kwargs.pop(item.param) for item in flag_fields(cls) if item.param in kwargs}


def pop_settings(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Take the settings flags' values out of a command's keyword arguments."""
    return {name: kwargs.pop(name) for name in SETTING_PARAMS if name in kwargs}


def settings_from(values: Mapping[str, Any]) -> Settings:
    """Settings from the flags' values; a bad value is a usage error naming its flag (exit status 2)."""
    try:
        return from_flags(values)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
