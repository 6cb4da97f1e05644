"""Validate a whole input file before any work starts, listing every problem with its line.

What is wrong with the file (a line that is no JSON object, a custom_id missing or used twice, the wrong
method or url, several models or an unknown one, too many lines, an empty file) fails the batch. What is
wrong with one request's body refuses that line alone: it is counted (`refused`) and stays in the line
index, and its worker writes its 400 to the error file; the rest of the batch runs. So does a line whose
`model` names neither the file's model nor one of its LoRA adapters, where that model has adapters
(`Validator._check_model`; the worker applies the same `pick_adapter`).

The file is streamed once, line by line, in bounded memory (a read buffer, a 16-byte digest per custom_id,
at most MAX_LISTED_ERRORS errors); the runtime feeds the same pass into its line index (`lines_with_offsets`).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import BinaryIO

from bulkgen.batch.images import ImageRef
from bulkgen.batch.requests import Fill, LineError, NotABatchFile, ParsedRequest, RequestLine, pick_adapter
from bulkgen.batch.schema import quote

MAX_LISTED_ERRORS = 1000
MAX_EMBEDDING_INPUTS = 50_000  # OpenAI's limit: embedding inputs of one batch, summed over its lines
READ_CHUNK = 1 << 20


@dataclass
class ValidationResult:
    total: int = 0
    model: str | None = None
    errors: list[dict] = field(default_factory=list)
    error_count: int = 0
    refused: list[dict] = field(default_factory=list)  # body errors: each refuses its line alone
    refused_count: int = 0

    @property
    def ok(self) -> bool:
        return self.error_count == 0

    def add(self, code: str, message: str, line: int | None = None, param: str | None = None) -> None:
        self.error_count += 1
        if len(self.errors) < MAX_LISTED_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})

    def refuse(self, err: LineError, line: int) -> None:
        self.refused_count += 1
        if len(self.refused) < MAX_LISTED_ERRORS:
            self.refused.append({"code": err.code, "line": line, "message": err.message, "param": err.param})

    def error_list(self) -> dict:
        """The `errors` field of a batch that failed: the file's problems and, so that one pass shows
        everything, the lines its body errors would have refused."""
        data = sorted(
            self.errors + self.refused[: MAX_LISTED_ERRORS - len(self.errors)], key=lambda e: e["line"] or 0
        )
        if self.error_count + self.refused_count > len(data):
            more = self.error_count + self.refused_count - len(data)
            data.append(
                {
                    "code": "too_many_errors",
                    "line": None,
                    "param": None,
                    "message": f"{more} more errors not listed; fix the ones above and validate again",
                }
            )
        return {"object": "list", "data": data}


class Validator:
    """Checks lines as they stream by: each line alone (the request parser), then across lines (one model,
    unique custom_ids, the request limit)."""

    def __init__(
        self,
        endpoint: str | None,
        served_models: Iterable[str],
        max_requests: int,
        adapters: Mapping[str, str] | None = None,
        check_images: Callable[[list[ImageRef]], None] | None = None,
        fill: Fill | None = None,
        found: bool = False,
        max_embedding_inputs: int = MAX_EMBEDDING_INPUTS,
    ) -> None:
        """`endpoint` None: the first request line's url (NotABatchFile where it names none).
        `adapters`: the served LoRA adapters, name -> the served model they run on.
        `check_images(refs)`: what validation can tell of a request's images (batch.images.check_images
        with the tenant's storage and the image policy); LineError refuses the line.
        `fill`: a watcher job's defaults, set in each line as it is parsed (`stored`). `found`: a file a
        watcher found rather than one sent as a batch, which is no batch file at all (NotABatchFile) unless
        its first request line is a JSON object, whatever the endpoint. `max_embedding_inputs`: the
        embedding inputs a batch may hold, summed over its `/v1/embeddings` lines (a line's `input` may be
        a list of up to 2,048), as OpenAI counts them."""
        self.endpoint, self.served, self.max_requests = endpoint, set(served_models), max_requests
        self.max_embedding_inputs = max_embedding_inputs
        self.embedding_inputs = 0
        self._inputs_over: int | None = None  # the line whose inputs took the total past the limit
        self.adapters = dict(adapters or {})
        self.check_images = check_images
        self.fill, self.found = fill, found
        self.stored: bytes | None = None  # the last line fed, as filled (None: as it came)
        self.result = ValidationResult()
        self._first_line = FirstLines()  # custom_id digest -> its first line
        # lines naming an unknown model before any line named a served one: decided once one does
        self._undecided: list[tuple[int, str]] = []
        self._first_unknown: tuple[int, str] | None = None
        self._base_adapters: set[str] = set()

    def feed(self, number: int, raw: bytes) -> ParsedRequest | None:
        """-> the request to index (a refused body's placeholder included); None for a blank line or a
        file error."""
        self.stored = None
        if not raw.strip():
            return None
        self.result.total += 1
        try:
            line = RequestLine.read(raw, number, self.endpoint, self.fill)
        except LineError as err:
            if self.found and self.result.total == 1 and err.code == "invalid_json_line":
                raise NotABatchFile(number) from None
            self.endpoint = self.endpoint or err.endpoint
            self.result.add(err.code, err.message, number, err.param)
            return None
        self.endpoint, self.stored = line.url, line.stored
        if not self._check_identity(line, number):
            return None
        try:
            request = line.request()
            if self.result.model is not None:
                request.lora = pick_adapter(line.model, self.result.model, self._base_adapters)
            elif len(self._undecided) < MAX_LISTED_ERRORS:
                self._undecided.append((number, line.model))
            if request.images and self.check_images is not None:
                self.check_images(request.images)
            if request.embedding is not None:  # an embeddings line
                self._count_inputs(request, number)
            return request
        except LineError as err:
            self.result.refuse(err, number)
            return line.placeholder()

    def finish(self) -> ValidationResult:
        result = self.result
        if self.endpoint is None:
            raise NotABatchFile(None, "the file has no request lines")
        if result.model is None and self._first_unknown is not None:
            number, model = self._first_unknown
            result.add("model_not_found", _not_served(model, self.served), number, "body.model")
        if result.total == 0:
            result.add("empty_file", "the input file has no requests")
        elif result.total > self.max_requests:
            result.add(
                "too_many_tasks",
                f"the file has {result.total} requests; the limit per batch is {self.max_requests} "
                "(split the file, or raise --max-requests-per-batch)",
            )
        if self.embedding_inputs > self.max_embedding_inputs:
            result.add(
                "too_many_embedding_inputs",
                f"the file has {self.embedding_inputs} embedding inputs (body.input, summed over its lines; "
                f"line {self._inputs_over} takes the total past the limit); the limit per batch is "
                f"{self.max_embedding_inputs} (split the file, or raise --max-embedding-inputs-per-batch)",
                self._inputs_over,
                "body.input",
            )
        return result

    def _count_inputs(self, request: ParsedRequest, number: int) -> None:
        self.embedding_inputs += len(request.prompts) if request.prompts else 1
        if self._inputs_over is None and self.embedding_inputs > self.max_embedding_inputs:
            self._inputs_over = number

    def _check_identity(self, request: RequestLine, number: int) -> bool:
        result, ok = self.result, True
        first = self._first_line.setdefault(_digest(request.custom_id), number)
        if first != number:
            result.add(
                "duplicate_custom_id",
                f"custom_id {quote(request.custom_id)} already used on line {first}",
                number,
                "custom_id",
            )
            ok = False
        return self._check_model(request.model, number) and ok

    def _check_model(self, model: str, number: int) -> bool:
        """One served model per file, its base: the first served model or adapter a line names. A line
        naming another served model fails the file; a line naming an unknown name or another base's adapter
        is that line's 400 (`pick_adapter`), except where the base has no adapters: then an unknown name is
        a second model, which fails the file as before adapters were served."""
        result = self.result
        base = model if model in self.served else self.adapters.get(model)
        if result.model is None:
            if base is None:
                self._first_unknown = self._first_unknown or (number, model)
                return True
            result.model = base
            self._base_adapters = {name for name, of in self.adapters.items() if of == base}
            for earlier, name in self._undecided:
                if self._check_model(name, earlier):
                    self._refuse_model(name, earlier)
            self._undecided = []
            return True
        if (model in self.served and model != result.model) or (base is None and not self._base_adapters):
            result.add(
                "model_mismatch",
                f"model {quote(model)} differs from {quote(result.model)}; one model per file",
                number,
                "body.model",
            )
            return False
        return True

    def _refuse_model(self, model: str, number: int) -> None:
        try:
            pick_adapter(model, self.result.model, self._base_adapters)
        except LineError as err:
            self.result.refuse(err, number)


def _not_served(model: str, served: set[str]) -> str:
    return f"model {quote(model)} is not served here; available: {sorted(served)}"


class FirstLines:
    """custom_id digest -> the line it was first seen on: SHARDS open-addressing tables of machine words (16
    bytes a slot: 95 bits of the digest and the line, at most 70% full), the shard picked by the digest's first
    byte. Each shard grows on its own, so growing never holds an old and a new copy of the whole table at once
    (one table of 20-byte slots took up to 86 bytes an id at the moment it doubled; the shards take 23-46,
    ~35 on average). A file of 10M lines keeps its ids in ~350 MB; the table lives while the file is
    validated. Two ids are taken for one only if 95 bits of their digests agree: ~2**-48 for 10M ids."""

    SHARDS = 256

    def __init__(self, slots: int = 1024) -> None:
        per_shard = max(8, slots // self.SHARDS)
        self._shards = [_Table(per_shard) for _ in range(self.SHARDS)]

    def __len__(self) -> int:
        return sum(len(shard) for shard in self._shards)

    def setdefault(self, digest: bytes, line: int) -> int:
        """The line `digest` was first seen on; `line` (now remembered) when it is new."""
        return self._shards[digest[0]].setdefault(digest, line)


class _Table:
    """One shard of FirstLines: linear probing over three machine-word arrays (digest bits 1-63, 64-95, line)."""

    MAX_LOAD = 0.7

    def __init__(self, slots: int) -> None:
        self._used = 0
        self._allocate(slots)

    def _allocate(self, slots: int) -> None:
        self._mask = slots - 1
        self._hi, self._lo = array("Q", bytes(8 * slots)), array("I", bytes(4 * slots))  # hi 0: empty
        self._line = array("I", bytes(4 * slots))  # line numbers below 2**32

    def __len__(self) -> int:
        return self._used

    def setdefault(self, digest: bytes, line: int) -> int:
        hi = int.from_bytes(digest[:8], "little") | 1  # never 0, the empty slot's mark
        lo = int.from_bytes(digest[8:12], "little")
        slot = lo & self._mask
        while (found := self._hi[slot]) != 0:
            if found == hi and self._lo[slot] == lo:
                return self._line[slot]
            slot = (slot + 1) & self._mask
        self._hi[slot], self._lo[slot], self._line[slot] = hi, lo, line
        self._used += 1
        if self._used > self.MAX_LOAD * (self._mask + 1):
            self._grow()
        return line

    def _grow(self) -> None:
        old = zip(self._hi, self._lo, self._line, strict=True)
        self._allocate(2 * (self._mask + 1))
        for hi, lo, line in old:
            if hi:
                slot = lo & self._mask
                while self._hi[slot]:
                    slot = (slot + 1) & self._mask
                self._hi[slot], self._lo[slot], self._line[slot] = hi, lo, line


def _digest(custom_id: str) -> bytes:
    """16 bytes per id seen, however long the ids (up to MAX_CUSTOM_ID_BYTES): a 50,000-line file of long
    ids costs the same memory as one of short ids. A collision would take ~2**64 ids."""
    return hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def validate_stream(
    reader: BinaryIO,
    validator: Validator,
    on_request: Callable[[int, int, bytes, ParsedRequest], None] | None = None,
    sink: BinaryIO | None = None,
) -> ValidationResult:
    """Stream a file through `validator`; `on_request(line, byte offset, raw, request)` sees each line of a
    valid file, refused ones included (the runtime builds its line index from it in this same pass).
    `sink`: where the file is stored as it is validated, each line as the validator filled it; offsets and
    lines are then the sink's, which is what the batch reads."""
    for number, start, raw in lines_with_offsets(reader):
        request = validator.feed(number, raw)
        if sink is not None:
            raw, start = validator.stored or raw, sink.tell()
            sink.write(raw + b"\n")
        if request is not None and on_request is not None:
            on_request(number, start, raw, request)
    return validator.finish()


def lines_with_offsets(reader: BinaryIO) -> Iterator[tuple[int, int, bytes]]:
    """(line number, byte offset, line without '\\n' / '\\r\\n'), read in 1 MB chunks."""
    offset, number, pending = (
        0,
        0,
        [],
    )  # pending: chunks of the line not yet ended (one long line stays linear)
    while chunk := reader.read(READ_CHUNK):
        pieces = chunk.split(b"\n")
        if len(pieces) == 1:
            pending.append(chunk)
            continue
        pieces[0] = b"".join(pending) + pieces[0]
        last = pieces.pop()
        pending = [last] if last else []
        for piece in pieces:
            number += 1
            yield number, offset, piece.removesuffix(b"\r")
            offset += len(piece) + 1
    if pending:
        yield number + 1, offset, b"".join(pending).removesuffix(b"\r")
