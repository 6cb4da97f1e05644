"""One writer and one naming scheme for result files (bulkgen.batch.resultfiles): `bulkgen run -o`, the
watcher and `bulkgen results` (plain and --merged) name every file `<stem>.<kind>`; the names are
recorded as the real doors write, on the session's Ray workers."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from bulkgen.batch.resultfiles import ResultNames, local_results
from bulkgen.batch.service import BatchService
from bulkgen.cli import cli
from bulkgen.watch.job import Job
from bulkgen.watch.watcher import Watcher
from tests.support.service import MODEL, chat_row, random_model, settings_for, write_jsonl


@pytest.fixture
def named(monkeypatch) -> list[str]:
    """Every name ResultNames gave out for a kind of file, in order."""
    names: list[str] = []
    original = ResultNames.of

    def recording(self, kind):
        names.append(original(self, kind))
        return names[-1]

    monkeypatch.setattr(ResultNames, "of", recording)
    return names


def rows(prefix: str) -> list[dict]:  # two that run, one refused for its body (an error line)
    return [chat_row(f"{prefix}-{i}", "hi", max_tokens=2) for i in range(2)] + [
        chat_row(f"{prefix}-bad", "hi", max_tokens=2, temperature=9)
    ]


def test_names_of_a_stored_batch_and_of_a_chosen_output_follow_one_rule():
    assert ResultNames("in/day1").output == "in/day1.output.jsonl"
    assert ResultNames("in/day1").of("errors.jsonl") == "in/day1.errors.jsonl"
    chosen = ResultNames.of_output("res.jsonl")
    assert (chosen.output, chosen.of("errors.jsonl")) == ("res.jsonl", "res.errors.jsonl")
    assert ResultNames.of_output("res").of("metrics.json") == "res.metrics.json"
    folder, names = local_results(Path("o/res.jsonl"))
    assert (folder.folder, names.output, names.of("errors.jsonl")) == (
        Path("o"),
        "res.jsonl",
        "res.errors.jsonl",
    )


def test_run_and_watcher_name_their_files_through_the_one_writer(service, named, tmp_path):
    src = write_jsonl(tmp_path / "run.jsonl", rows("run"))
    out = tmp_path / "local" / "res.jsonl"
    args = [
        "run",
        str(src),
        "-o",
        str(out),
        "--storage",
        str(tmp_path / "s1"),
        "--model",
        f"{MODEL}={random_model()}",
    ]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.parent.iterdir()) == [
        "res.errors.jsonl",
        "res.jsonl",
        "res.metrics.json",
    ]
    assert named == ["res.errors.jsonl", "res.metrics.json"]

    named.clear()
    inbox = tmp_path / "inbox"
    inbox.mkdir()
    write_jsonl(inbox / "day1.jsonl", rows("watch"))
    spec = Job(input=str(inbox), output=str(tmp_path / "outbox"))
    Watcher(BatchService(settings_for(str(tmp_path / "s2"))), spec).run(once=True)
    written = sorted(p.name for p in (tmp_path / "outbox").iterdir() if not p.name.startswith("."))
    assert written == ["day1.errors.jsonl", "day1.output.jsonl", "day1.summary.json"]
    assert named == ["day1.errors.jsonl", "day1.summary.json"]
