"""`bulkgen watch` on local folders (the embedded default): results, bad input, a crash, a restart, a change."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.held_engine import HOLD
from tests.support.service import chat_row
from tests.support.watch import ROOT, rows_jsonl, wait_until


def claims_of(store: Path, key: str) -> list[dict]:
    found = [json.loads(p.read_text()) for p in (store / "watch" / "claims").glob("*.json")]
    return [c for c in found if c["key"] == key]


def batches_of(store: Path, key: str) -> list[dict]:
    records = [json.loads(p.read_text()) for p in (store / "batches").glob("*.json")]
    return sorted(
        (r for r in records if r["metadata"]["watch_input"].endswith("/" + key)),
        key=lambda r: r["created_at"],
    )


def summary(outbox: Path, stem: str) -> dict | None:
    path = outbox / f"{stem}.summary.json"
    return json.loads(path.read_text()) if path.exists() else None


@pytest.mark.slow
def test_watch_folder_bad_input_crash_restart_and_change(tmp_path, watch_process, engine_gate):
    inbox, outbox, store = tmp_path / "inbox", tmp_path / "outbox", tmp_path / "store"
    inbox.mkdir()
    (inbox / "a.jsonl").write_bytes(
        rows_jsonl([chat_row(f"a-{i}", f"hello {i}", max_tokens=4) for i in range(4)])
    )
    (inbox / "notes.txt").write_text("not a batch\n")
    (inbox / "broken.jsonl").write_text("oops, plain text\n")
    (inbox / "invalid.jsonl").write_bytes(
        rows_jsonl([chat_row("ok", "x"), chat_row("hot", "x", temperature=9)])
    )
    (inbox / "summarize.jsonl").write_bytes((ROOT / "samples" / "watch" / "summarize.jsonl").read_bytes())
    # the example job, pointed at this test's folders: its url, model and defaults fill what lines lack
    args = (
        "--job",
        str(ROOT / "jobs" / "summarize-inbox.yaml"),
        "--input",
        str(inbox),
        "--output",
        str(outbox),
        "--storage",
        str(store),
        "--interval",
        "1",
        "--claim-ttl",
        "4",
        "--lease-ttl",
        "3",
    )
    first = watch_process(tmp_path / "first.log", *args)

    done = wait_until(lambda: summary(outbox, "a"), 180, "a.summary.json", first)
    assert done["batch"]["status"] == "completed" and done["batch"]["request_counts"]["completed"] == 4
    assert done["source"]["key"] == "a.jsonl" and done["written"] == ["a.output.jsonl"]
    lines = [json.loads(line) for line in (outbox / "a.output.jsonl").read_text().splitlines()]
    assert [line["custom_id"] for line in lines] == ["a-0", "a-1", "a-2", "a-3"]
    summarized = wait_until(lambda: summary(outbox, "summarize"), 60, "summarize.summary.json", first)
    used = [
        json.loads(line)["response"]["body"]["usage"]["completion_tokens"]
        for line in (outbox / "summarize.output.jsonl").read_text().splitlines()
    ]
    assert len(used) == 3 and max(used) == 64 >= min(used)  # the job's max_tokens (this model rarely stops)
    assert (
        summarized["batch"]["model"] == "bulkgen-tiny"
        and summarized["batch"]["endpoint"] == "/v1/chat/completions"
    )
    # a body error refuses its line alone: the batch completes, the line's 400 in the error file
    invalid = wait_until(lambda: summary(outbox, "invalid"), 120, "invalid.summary.json", first)
    assert invalid["batch"]["status"] == "completed" and not (outbox / "invalid.errors.json").exists()
    errors = [json.loads(line) for line in (outbox / "invalid.errors.jsonl").read_text().splitlines()]
    assert [(e["custom_id"], e["response"]["body"]["error"]["param"]) for e in errors] == [
        ("hot", "body.temperature")
    ]
    assert "line 1: not a JSON object" in json.loads((outbox / "broken.report.json").read_text())["reason"]
    assert "only *.jsonl" in json.loads((outbox / "notes.txt.report.json").read_text())["reason"]
    assert not (outbox / "broken.summary.json").exists() and batches_of(store, "broken.jsonl") == []

    # a long batch, held at the engine gate, and the watcher dies (SIGKILL, Ray with it) while it runs
    long_rows = rows_jsonl([chat_row(f"long-{i}", f"{HOLD} tell me {i}", max_tokens=64) for i in range(16)])
    (inbox / ".long.jsonl.part").write_bytes(long_rows)  # hidden while it is being written: never claimed
    (inbox / ".long.jsonl.part").rename(inbox / "long.jsonl")

    def long_in_progress():
        claims = claims_of(store, "long.jsonl")
        if claims and claims[0]["batch_id"]:
            record = json.loads((store / "batches" / f"{claims[0]['batch_id']}.json").read_text())
            return record["status"] == "in_progress" and record["id"]

    long_batch = wait_until(long_in_progress, 60, "the long batch in progress", first)
    engine_gate.wait_held()
    first.kill()
    engine_gate.open()  # the second watcher runs it to its end
    (inbox / "a.jsonl").write_bytes(
        rows_jsonl([chat_row(f"a2-{i}", f"again {i}", max_tokens=4) for i in range(3)])
    )

    second = watch_process(tmp_path / "second.log", *args)
    wait_until(
        lambda: (summary(outbox, "long") or {}).get("batch", {}).get("status") == "completed",
        180,
        "long.summary.json",
        second,
    )
    wait_until(
        lambda: summary(outbox, "a")["batch"]["id"] != done["batch"]["id"], 60, "a.jsonl again", second
    )

    assert f"long.jsonl: resuming batch {long_batch}" in second.text()
    assert [b["id"] for b in batches_of(store, "long.jsonl")] == [long_batch]  # resumed, not created twice
    assert summary(outbox, "long")["batch"]["request_counts"] == {"total": 16, "completed": 16, "failed": 0}
    changed = batches_of(store, "a.jsonl")
    assert len(changed) == 2 and changed[0]["id"] == done["batch"]["id"]  # once per version of the object
    assert [
        json.loads(line)["custom_id"] for line in (outbox / "a.output.jsonl").read_text().splitlines()
    ] == ["a2-0", "a2-1", "a2-2"]
    assert len(batches_of(store, "invalid.jsonl")) == 1
    for finished in (
        "broken.jsonl",
        "notes.txt",
        "invalid.jsonl",
        "summarize.jsonl",
    ):  # nothing done twice after the restart
        assert finished not in second.text()
    claim_files = list((store / "watch" / "claims").glob("*.json"))
    assert len(claim_files) == 7  # one per object version: a (twice), summarize, notes, broken, invalid, long
    wait_until(
        lambda: all(json.loads(p.read_text())["state"] == "done" for p in claim_files), 10, "claims done"
    )
    assert second.alive() and "Traceback" not in first.text() + second.text()
