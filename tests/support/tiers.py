"""The test tiers, by what a test starts: Ray, a server, a subprocess.

`tests/conftest.py` marks every collected test with what it starts (`ray`, `server`, `subprocess`) and
marks `fast` the tests that start none of them and are not `slow` (long in themselves): the edit-test tier,
`python -m pytest -m fast`. A test is read from what it is made of, so a new test falls into its tier
without a marker written on it:

- the fixtures it uses, whose names say what they start (`FIXTURES`);
- the source of the test, of every fixture it uses and of every function of the test package these call
  (followed through their names), matched against what starting each thing looks like (`SIGNS`).

What the reading misses, the fast tier's guard (`fast_tier_guard`) catches at run time: a `fast` test that
starts Ray, a uvicorn server or a subprocess fails, naming the mark to write on it (the marks written on a
test count as read).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
import subprocess
import types
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
STARTS = ("ray", "server", "subprocess")
FIXTURES = {
    "service": {"ray", "server"},
    "client": {"ray", "server"},
    "s3_server": {"server"},
    "s3_bucket_url": {"server"},
    "flaky_proxy": {"server"},
    "seaweedfs_server": {"server", "subprocess"},
    "seaweedfs_bucket_url": {"server", "subprocess"},
    "serve_process": {"ray", "server", "subprocess"},
    "watch_process": {"ray", "subprocess"},
    "rank_pool": {"subprocess"},
}
# what starting each thing looks like in a test's source: Ray itself, or bulkgen's doors to it (the runtime's
# `init_ray` and `BatchManager`, the `run`, `serve` and `watch` commands); `tensor_parallel=2` starts ranks
SIGNS = {
    "ray": re.compile(
        r"\bray\.init\(|\binit_ray\(|\bimport ray\b|\bfrom ray\b|\bBatchManager\(|\[\s*\"(run|serve|watch)\","
    ),
    "server": re.compile(r"\buvicorn\b|ThreadedMotoServer|HTTPServer\(|\bServeProcess\(|\bService\("),
    "subprocess": re.compile(
        r"\bsubprocess\.|\bPopen\(|sys\.executable|\bmultiprocessing\b|tensor_parallel=(?![01]\b|None\b)\w"
    ),
}


def tier_marks(fixtures: Iterable[str], functions: Iterable[Callable]) -> set[str]:
    """What a test starts, from the names of the fixtures it uses and the test function with its
    fixtures' functions."""
    marks = set()
    for name in fixtures:
        marks |= FIXTURES.get(name, set())
    source = "\n".join(_sources(functions))
    return marks | {what for what, sign in SIGNS.items() if sign.search(source)}


def _sources(functions: Iterable[Callable]) -> Iterable[str]:
    """The source of each function and of every function of the test package it names, each once."""
    seen: set[types.CodeType] = set()
    todo = [inspect.unwrap(f) for f in functions if isinstance(inspect.unwrap(f), types.FunctionType)]
    while todo:
        func = todo.pop()
        if func.__code__ in seen:
            continue
        seen.add(func.__code__)
        try:
            yield inspect.getsource(func)
        except (OSError, TypeError):
            continue
        todo.extend(_called(func))


def _called(func: types.FunctionType) -> Iterable[types.FunctionType]:
    """The functions of the test package that `func` names (in its body or nested functions), and the
    methods of the test package's classes it names."""
    for name in _names(func.__code__):
        value = func.__globals__.get(name)
        if isinstance(value, type):
            yield from (v for v in vars(value).values() if _ours(v))
        elif _ours(value):
            yield value


def _ours(value: object) -> bool:
    return isinstance(value, types.FunctionType) and Path(value.__code__.co_filename).is_relative_to(TESTS)


def _names(code: types.CodeType) -> Iterable[str]:
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def _installed(name: str) -> types.ModuleType | None:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError:
        return None


@contextlib.contextmanager
def fast_tier_guard(test: str) -> Iterator[None]:
    """While `test` runs (its fixtures' setup and teardown included), starting Ray, a uvicorn server or a
    process raises, naming the mark to write on the test. The one process allowed is the engine's own
    schema compiler (bulkgen/engine/features/schema_compiler.py): the code under test starts it once per test run
    and keeps it, as it keeps it in a worker, and tests of a crashing schema restart it on purpose. Where Ray
    or uvicorn is not installed (the GPU image has neither) nothing can start it, so there is nothing to guard."""
    from bulkgen.engine.features import schema_compiler

    ray = _installed("ray")
    uvicorn = _installed("uvicorn")

    def refuse(what: str, mark: str):
        def start(*args, **kwargs):
            raise RuntimeError(f"{test} starts {what}: mark it @pytest.mark.{mark}")

        return start

    execute = subprocess.Popen._execute_child

    def child(popen, args, *rest, **kwargs):
        if schema_compiler.__file__ not in list(args):
            refuse("a subprocess", "subprocess")()
        return execute(popen, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        if ray is not None:
            patch.setattr(ray, "init", refuse("Ray", "ray"))
        if uvicorn is not None:
            patch.setattr(uvicorn.Server, "serve", refuse("a uvicorn server", "server"))
        patch.setattr(subprocess.Popen, "_execute_child", child)
        yield
