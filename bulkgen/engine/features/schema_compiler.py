"""JSON schemas compiled into llguidance grammars in a helper process, bounded in size and in time.

Why a process: some schemas crash llguidance outright (a chain of 1,000 `$ref`s, a `const` object of 40,000
keys or a `required` list of 100,000 names overflow its stack: SIGSEGV), and it has no wall-clock limit (a
500 KB schema of patterns takes seconds). In a child, a compile past COMPILE_TIMEOUT_S is killed and a crash
costs that schema alone, while every thread of the caller (the API's event loop included) runs on: each is
a GrammarError, its line's 400, like any schema the compiler refuses. A schema over MAX_SCHEMA_BYTES is
refused before anything is compiled.

The child also takes the grammar's first PROBE_STEPS steps with a byte-level tokenizer, choosing the lowest
byte allowed each time: a schema whose matcher fails there (a `$ref` to itself, a pattern past the lexer's
limits) admits no document and is refused now, instead of "completing" with an empty output. A failure
further in is found by the engine at run time (grammar.GrammarRuntime), where it is that request's error.

One child per process, started on first use, compiles one schema at a time (callers cache the results:
grammar.grammar). Run as a script, this module is the child: one JSON line in and one out per schema.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import subprocess
import sys
import threading
import time

MAX_SCHEMA_BYTES = 512 * 1024
COMPILE_TIMEOUT_S = 10.0  # a 500 KB schema of 7,000 patterned properties takes ~4 s on a 2-core CPU
PROBE_STEPS = 32
MAX_REASON_CHARS = 300
# llguidance's own bounds (LLParserLimits; its defaults, written out) for every matcher, in the child and in
# the engine, so what passed here runs there; verbose errors would dump the parser state into the reason
LIMITS = {
    "max_items_in_row": 2000,
    "initial_lexer_fuel": 1_000_000,
    "step_lexer_fuel": 200_000,
    "step_max_items": 50_000,
    "max_lexer_states": 250_000,
    "max_grammar_size": 500_000,
    "verbose_errors": False,
}
_CARETS = re.compile(r"\^{2,}")
_BACKTRACE = re.compile(r"\n\s*(stack backtrace:|\d+: |note: run with `RUST_BACKTRACE)")


class GrammarError(ValueError):
    """A schema the grammar compiler cannot turn into a grammar (unsupported, unsatisfiable, too large)."""


def compile_schema(schema: str | None) -> str:
    """The llguidance grammar of `schema` (JSON text; None: any JSON object). GrammarError with a one-line
    reason for a schema too large, too slow to compile, that crashes the compiler, or that it refuses."""
    size = 0 if schema is None else len(schema.encode())
    if size > MAX_SCHEMA_BYTES:
        raise GrammarError(f"the schema is {size:,} bytes of JSON; at most {MAX_SCHEMA_BYTES:,} are allowed")
    reply = _CHILD.ask(schema)
    if "error" in reply:
        raise GrammarError(reply["error"])
    return reply["grammar"]


def reason(message: str) -> str:
    """The compiler's message as one line of at most MAX_REASON_CHARS: a native backtrace cut off, and a
    long echo of the schema shortened in the middle (the error itself is usually at the end)."""
    message = _BACKTRACE.split(message, maxsplit=1)[0].replace("<non-verbose/>", "")
    message = " ".join(_CARETS.sub("^", message).split())  # a regex error underlines the whole pattern
    if len(message) > MAX_REASON_CHARS:
        half = MAX_REASON_CHARS // 2 - 2
        message = f"{message[:half]} … {message[-half:]}"
    return message


class _Child:
    """The compiler process of this process, replaced after a crash or a timeout."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._parent = 0  # the process that started it: a forked copy of this object starts its own

    def ask(self, schema: str | None) -> dict:
        with self._lock:
            if self._parent != os.getpid() or self._proc is None or self._proc.poll() is not None:
                self._parent = os.getpid()
                self._proc = subprocess.Popen(
                    [sys.executable, __file__],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.DEVNULL,
                )
            proc = self._proc
            try:
                proc.stdin.write(json.dumps({"schema": schema}).encode() + b"\n")
                proc.stdin.flush()
                return self._reply(proc, time.monotonic() + COMPILE_TIMEOUT_S)
            except (OSError, ValueError):  # the child died mid-request
                return {"error": self._lost(proc)}

    def _reply(self, proc: subprocess.Popen, deadline: float) -> dict:
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            self._lost(proc)
            return {"error": f"the schema took longer than {COMPILE_TIMEOUT_S:g} s to compile"}
        return json.loads(proc.stdout.readline())  # ValueError at EOF: a crash

    def _lost(self, proc: subprocess.Popen) -> str:
        """Stop a child that crashed or ran out of time; -> why, for a crash."""
        proc.kill()
        code = proc.wait()
        self._proc = None
        if code < 0 and code != -signal.SIGKILL:
            return f"the grammar compiler crashed on the schema ({signal.Signals(-code).name})"
        return f"the grammar compiler stopped on the schema (exit status {code})"


_CHILD = _Child()


# -- the child -------------------------------------------------------------------------------------------
class _ByteTokens:
    """A vocabulary of the 256 bytes and an end token, to walk a grammar without the model's tokenizer."""

    eos_token_id, bos_token_id, special_token_ids = 256, None, [256]
    tokens = [bytes([b]) for b in range(256)] + [b"<end>"]

    def __call__(self, text: bytes) -> list[int]:
        return list(text)


def _compile(ll, tokenizer, schema: str | None) -> str:
    compiler = ll.JsonCompiler(separators=(", ", ": "), whitespace_flexible=False)
    grammar = compiler.compile('{"type": "object"}' if schema is None else schema, check=False)
    limits = ll.LLParserLimits(**LIMITS)
    is_error, messages = ll.LLMatcher.validate_grammar_with_warnings(grammar, limits=limits)
    if is_error:
        raise GrammarError("; ".join(messages))
    _probe(ll.LLMatcher(tokenizer, grammar, limits=limits, log_level=0))
    return grammar


def _probe(matcher) -> None:
    """Walk the first PROBE_STEPS bytes of a document (the lowest byte allowed each step)."""
    for _ in range(PROBE_STEPS):
        mask = matcher.compute_bitmask()  # bit b of byte b // 8: byte b may come next
        byte = next((b for b in range(256) if mask[b // 8] >> (b % 8) & 1), None)
        if matcher.is_error():
            raise GrammarError(f"the schema admits no document: {matcher.get_error()}")
        if byte is None:  # only the end may follow
            if matcher.is_accepting():
                return
            raise GrammarError("the schema admits no document: nothing may follow its start")
        if not matcher.consume_token(byte):
            raise GrammarError(f"the schema admits no document: {matcher.get_error()}")
        if matcher.is_stopped():
            return


def _serve() -> None:
    import llguidance

    tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens()))
    for line in sys.stdin.buffer:
        try:
            reply = {"grammar": _compile(llguidance, tokenizer, json.loads(line)["schema"])}
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as exc:  # a Rust panic arrives as pyo3's PanicException, a BaseException
            reply = {"error": reason(str(exc)) or type(exc).__name__}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    sys.path.pop(0)  # this file's folder: its module names (config, sequence, ...) must not shadow others
    try:
        _serve()
    except KeyboardInterrupt:  # the parent's terminal was interrupted; the parent decides what that means
        pass
