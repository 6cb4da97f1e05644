"""Constrained decoding: a JSON schema (or plain JSON mode) as a mask over the next token.

llguidance compiles a schema into a grammar once per process (cached by the schema's canonical text, never
once per request; in a helper process bounded in size and time, schema_compiler.py) and gives each sequence
a matcher: before a step samples, each constrained row's matcher fills
one row of a packed bitmask (32 tokens per int32 word) with the tokens that keep the output a prefix of
some valid document (on a GPU while the forward runs, see Engine._start_masks); the sampler sets every other logit to -inf on the logits' device; after sampling,
the matcher consumes the chosen token. The end-of-sequence token is allowed exactly when the document
is complete, so a request that finishes with `stop` holds valid JSON, and one cut by max_tokens ends
with `length`, as the hosted API does. A matcher that fails (a grammar past llguidance's limits at some
step) fails its request with the reason (Engine: `RequestOutput.error`), never a `stop`.

Why llguidance (bench/grammar_libs.py compares it with xgrammar on the bundled tokenizer): both compile
every schema feature of the corpus ($defs/$ref recursion, anyOf, enum, const, pattern, min/maxItems,
minimum/maximum, additionalProperties false, string formats), but xgrammar let raw control characters
into JSON strings (2-3 of 10 random walks per string schema gave invalid JSON) where llguidance gave
none; llguidance is one 3 MB wheel with no dependencies (xgrammar pulls triton, tvm-ffi and pydantic),
reports unsupported schemas without a tokenizer (so the driver can refuse them at validation), and
fills masks for a whole batch in parallel threads outside the GIL. Output JSON is compact (", " and ": "
separators, no free whitespace), which keeps small models from wandering in whitespace.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from bulkgen.engine.features.guide import GrammarError, Guide, grammar
from bulkgen.engine.features.reasoning_gate import ReasoningGate, ReasoningSpec
from bulkgen.engine.features.schema_compiler import LIMITS, reason


class GrammarRuntime:
    """One engine's grammar machinery: its tokenizer as llguidance sees it, matchers, batched masks."""

    def __init__(self, hf_tokenizer, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self._ll, self._llt = llguidance, llguidance.torch
        self.vocab_size = vocab_size  # the model's (may exceed the tokenizer's: padded embeddings)
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size)
        self._limits = llguidance.LLParserLimits(**LIMITS)
        self._pristine: dict[Guide, object] = {}  # a never-advanced matcher per guide, to copy from
        # A few threads fill a step's masks; llguidance's default (a thread per core) spends more time
        # waking threads than filling on small batches, and competes with the forward's own threads.
        self.executor = llguidance.LLExecutor(max(1, min(4, (os.cpu_count() or 2) // 2)))

    def matcher(self, guide: Guide | None, reasoning: ReasoningSpec | None = None):
        """A fresh matcher at the start of the document; one per sequence (n > 1 gets one each): a copy
        of the guide's pristine matcher (100x cheaper than parsing the grammar again). With `reasoning`,
        a ReasoningGate in front of it (reasoning_gate.py): the grammar applies from the answer on."""
        inner = None if guide is None else self._guide_matcher(guide)
        return inner if reasoning is None else ReasoningGate(reasoning, inner)

    def _guide_matcher(self, guide: Guide):
        pristine = self._pristine.get(guide)
        if pristine is None:
            pristine = self._ll.LLMatcher(self.tokenizer, grammar(guide), limits=self._limits, log_level=0)
            if pristine.is_error():
                raise GrammarError(reason(pristine.get_error()))
            if len(self._pristine) >= 1024:
                self._pristine.clear()
            self._pristine[guide] = pristine
        return pristine.deep_copy()

    def masks(self, matchers: list, unpacked: bool = False) -> torch.Tensor:
        """[len(matchers), words] int32 bitmask of each matcher's allowed next tokens, filled in
        parallel threads (the GIL is released), on the host; `unpacked`: as [len, vocab] bool instead
        (for a CPU engine, whose mask thread then does the unpacking too)."""
        bitmask = self._llt.allocate_token_bitmask(len(matchers), self.vocab_size)
        grammars, gates = [], []
        for i, m in enumerate(matchers):
            if isinstance(m, ReasoningGate):
                gates.append((i, m))
                m = _gate_row(m, bitmask[i])
            if m is not None:
                grammars.append((m, i))
        if grammars:
            self._llt.fill_next_token_bitmask_par(self.executor, grammars, bitmask)
        _open_bits(gates, bitmask)
        return unpack(bitmask, self.vocab_size) if unpacked else bitmask

    @staticmethod
    def consume(matcher, token: int) -> bool:
        """Advance past a sampled token; False if the matcher failed doing so (`failure` says why)."""
        return matcher.consume_token(token)

    @staticmethod
    def failure(matcher) -> str:
        """Why `matcher` failed, "" if it has not: filling its mask or consuming a token, the grammar hit
        one of llguidance's limits (a lexer out of fuel, say). Its mask then let only the end through, and
        that must not read as a finished document."""
        if not matcher.is_error():
            return ""
        return f"the schema's grammar failed during decoding: {reason(matcher.get_error())}"


def _gate_row(gate: ReasoningGate, row: torch.Tensor):
    """Fill `row` for a gate that decides it alone (every token, or its one forced token); the grammar
    matcher that fills it otherwise."""
    forced = gate.forced_token()
    if forced is not None:
        row.zero_()
        row[forced // 32] = (1 << (forced % 32)) - (1 << 32 if forced % 32 == 31 else 0)
        return None
    if gate.grammar() is None:
        row.fill_(-1)
    return gate.grammar()


def _open_bits(gates: list[tuple[int, ReasoningGate]], bitmask: torch.Tensor) -> None:
    """Let each gate's opening token through beside its grammar's mask (ReasoningGate.opening_token)."""
    for i, gate in gates:
        token = gate.opening_token()
        if token is not None:
            word = int(bitmask[i, token // 32]) & 0xFFFFFFFF | (1 << (token % 32))
            bitmask[i, token // 32] = word - (1 << 32) if word >= 1 << 31 else word


_POW2: dict[torch.device, torch.Tensor] = {}


def unpack(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """[n, words] packed int32 -> [n, vocab] bool (token t allowed: bit t % 32 of word t // 32)."""
    device = bitmask.device
    if device.type == "cpu":  # numpy's unpackbits: ~15x torch's shifts on the host
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")[:, :vocab]
        return torch.from_numpy(bits.view(np.bool_))
    if device not in _POW2:
        _POW2[device] = (torch.ones(32, dtype=torch.int64) << torch.arange(32)).to(torch.int32).to(device)
    return (bitmask[:, :, None] & _POW2[device]).ne(0).flatten(1)[:, :vocab]


def apply_masks(logits: torch.Tensor, rows: torch.Tensor, masks: torch.Tensor) -> None:
    """Set to -inf, in place on the logits' device, every logit of `rows` that `masks` does not allow:
    one row of masks per index of `rows`, packed int32 bitmask (copied, then unpacked on the device) or
    already unpacked bool (what the mask thread makes for a CPU engine, off the step's critical path)."""
    if masks.dtype != torch.bool:
        masks = unpack(masks.to(logits.device, non_blocking=True), logits.shape[1])
    forbidden = masks.logical_not()
    if rows.numel() == logits.shape[0]:  # every row constrained, in order: no gather and scatter
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        logits[rows] = logits[rows].masked_fill(forbidden, float("-inf"))
