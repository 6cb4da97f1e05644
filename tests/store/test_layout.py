"""The storage layout: its keys are the keys stored data already has, the code writes exactly those keys,
and no module but bulkgen.store.layout spells a storage key."""

from __future__ import annotations

import ast
import io
import json
from pathlib import Path

from bulkgen.batch import lifecycle
from bulkgen.batch.service import BatchService
from bulkgen.metrics import BatchMetrics
from bulkgen.plan import profile
from bulkgen.runtime import parts
from bulkgen.runtime.finalize import finalize, result_file_ids
from bulkgen.runtime.lease import Lease
from bulkgen.settings import Settings
from bulkgen.store import LocalStore, ObjectInfo, layout
from bulkgen.store.local import INTERNAL_DIR
from bulkgen.watch.claims import Claims

PACKAGE = Path(layout.__file__).resolve().parents[1]
ROW = {
    "custom_id": "r1",
    "method": "POST",
    "url": "/v1/chat/completions",
    "body": {"model": "m", "messages": [{"role": "user", "content": "hi"}]},
}


KEYS = [  # (what the layout names, the key stored data already has)
    (layout.file_meta("file-a"), "files/meta/file-a.json"),
    (layout.file_data("file-a"), "files/data/file-a"),
    (layout.file_refs("file-a"), "files/refs/file-a/"),
    (layout.file_ref("file-a", "batch_b"), "files/refs/file-a/batch_b"),
    (layout.file_use("file-a"), "files/use/file-a.json"),
    (layout.batch("batch_b"), "batches/batch_b.json"),
    (layout.part("batch_b", 1, 32), "parts/batch_b/lines-000000001-000000032.jsonl"),
    (layout.part_lines("batch_b"), "parts/batch_b/lines-"),
    (layout.runner_note("batch_b", "host-1"), "parts/batch_b/runner-host-1.json"),
    (layout.lease("batch_b"), "leases/batch_b.json"),
    (layout.report("batch_b", "report.json"), "reports/batch_b/report.json"),
    (layout.metrics_state("batch_b"), "reports/batch_b/metrics-state.json"),
    (layout.active("batch_b"), "active/batch_b"),
    (layout.active("batch_b", "acme"), "active/acme/batch_b"),
    (layout.tenant_root("acme"), "tenants/acme"),
    (layout.watch_claim("h1"), "watch/claims/h1.json"),
    (layout.watch_done("h1"), "watch/done/h1"),
    (layout.profile("tiny", "cpu"), "profiles/tiny/cpu.json"),
    (layout.webhook_pending("evt_1"), "webhooks/pending/evt_1.json"),
    (layout.TOTALS, "meta/totals.json"),
    (layout.output_filename("batch_b"), "batch_b_output.jsonl"),
    (layout.error_filename("batch_b"), "batch_b_error.jsonl"),
]


def test_keys_are_the_keys_existing_storage_holds():
    """Spelled out once: a changed key would orphan every object already stored under the old one."""
    assert [named for named, _ in KEYS] == [stored for _, stored in KEYS]


def test_parsers_invert_the_keys():
    assert layout.part_range(layout.part("batch_b", 7, 9)) == (7, 9)
    assert layout.part_range(layout.runner_note("batch_b", "o")) is None
    assert layout.parts_batch(layout.runner_note("batch_b", "o")) == "batch_b"
    assert layout.is_runner_note(layout.runner_note("batch_b", "o"))
    assert not layout.is_runner_note(layout.part("batch_b", 1, 2))
    assert layout.lease_batch(layout.lease("batch_b")) == "batch_b"
    assert layout.batch_id_of(layout.batch("batch_b")) == "batch_b"
    assert layout.ref_batch(layout.file_ref("file-a", "batch_b")) == "batch_b"
    assert layout.active_entry(layout.active("batch_b", "acme")) == ("acme", "batch_b")
    assert layout.active_entry(layout.active("batch_b")) == ("", "batch_b")
    assert layout.watch_done_name(layout.watch_done("h1")) == "h1"
    assert layout.profile_device(layout.profile("tiny", "nvidia-h200")) == "nvidia-h200"
    assert layout.tenant_names([layout.tenant_root("acme") + "/" + layout.batch("b"), "tenants/x"]) == {
        "acme"
    }


def _metrics() -> BatchMetrics:
    metrics = BatchMetrics()
    metrics.add_request(
        {"arrival_time": 1.0, "finished_time": 2.0, "prompt_tokens": 3, "completion_tokens": 2}
    )
    return metrics


def test_a_batch_of_a_tenant_writes_exactly_the_layouts_keys(tmp_path):
    """One batch of a non-default tenant, from upload to finalize, plus a watcher claim and a profile: every
    key on the storage is one the layout names, under the tenant's root where the object is the tenant's."""
    root = LocalStore(tmp_path / "store", fsync=False)
    root.create()
    svc = BatchService(Settings(storage=str(tmp_path / "store")), store=root).for_tenant("acme")
    file_id = svc.files.create(io.BytesIO(json.dumps(ROW).encode() + b"\n"), "in.jsonl", "batch")["id"]
    batch_id = svc.create_batch(file_id, "/v1/chat/completions", "24h", None).id
    svc.batches.update(batch_id, lambda r: lifecycle.transition(r, "in_progress"))
    lease = Lease(svc.store, batch_id, "host-1", ttl_s=30)
    assert lease.acquire()
    parts.write_part(
        svc.store,
        batch_id,
        1,
        2,
        [parts.PartEntry.of(1, True, {"id": "ok"}), parts.PartEntry.of(2, False, {"id": "e"})],
    )
    tenant = layout.tenant_root("acme") + "/"
    before_finalize = set(root.list(""))
    assert {tenant + layout.part(batch_id, 1, 2), layout.active(batch_id, "acme")} <= before_finalize

    record = finalize(svc, batch_id, None, _metrics())
    lease.release()
    claims = Claims(svc.store, "file:///inbox", "watcher-1", ttl_s=30)
    claim = claims.take(ObjectInfo("day1.jsonl", 10, "etag-1"))
    claims.finish(claim)
    profile.save(root, profile.Profile("tiny", "cpu", 0.01, 0.001, 0.0, 0.0, 8, 256, 128, 16, 1.0))

    output_id, error_id = result_file_ids(batch_id)
    assert (record.output_file_id, record.error_file_id) == (output_id, error_id)
    tenant_keys = [
        layout.file_meta(file_id),
        layout.file_data(file_id),
        layout.file_ref(file_id, batch_id),
        layout.file_use(file_id),
        layout.batch(batch_id),
        layout.file_meta(output_id),
        layout.file_data(output_id),
        layout.file_meta(error_id),
        layout.file_data(error_id),
        *(layout.report(batch_id, name) for name in ("report.json", "report.png")),
        layout.watch_claim(claim.name),
        layout.watch_done(claim.name),
    ]
    stored = {key for key in root.list("") if INTERNAL_DIR not in key.split("/")}  # a sub-store's own locks
    assert stored == {tenant + key for key in tenant_keys} | {
        layout.TOTALS,
        layout.profile("tiny", "cpu"),
    }
    assert record.metrics["report_files"] == {
        n: layout.report(batch_id, n) for n in ("report.json", "report.png")
    }
    assert svc.files.get(output_id)["filename"] == layout.output_filename(batch_id)
    assert svc.files.get(error_id)["filename"] == layout.error_filename(batch_id)


def test_the_dashboard_downloads_the_error_file_under_its_stored_name():
    app = (PACKAGE / "api" / "static" / "app.js").read_text()
    assert layout.error_filename("${b.id}") in app and layout.output_filename("${b.id}") in app


def _key_pieces() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the layout's top-level folders, the names it puts inside them)."""
    names = [v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str)]
    folders = tuple(sorted({v.split("/", 1)[0] + "/" for v in names if "/" in v}))
    return folders, (layout.LINES, layout.RUNNER, layout.METRICS_STATE)


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def test_no_module_but_the_layout_spells_a_storage_key():
    """Every string in the package's code (f-string pieces included, docstrings not) that starts with a
    storage folder or holds a key name: only bulkgen/store/layout.py may have one."""
    folders, names = _key_pieces()
    assert {
        "files/",
        "batches/",
        "active/",
        "parts/",
        "leases/",
        "reports/",
        "tenants/",
        "meta/",
        "watch/",
        "profiles/",
        "webhooks/",
    } <= set(folders)
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(layout.__file__).resolve():
            continue
        tree = ast.parse(path.read_text(), str(path))
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if node.value.startswith(folders) or any(n in node.value for n in names):
                    found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value[:60]!r}")
    assert found == []
