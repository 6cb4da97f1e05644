"""The dashboard in a real browser: create, watch, inspect, download, cancel, bad files, the key prompt."""

from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from playwright.sync_api import expect

from tests.support.held_engine import HOLD
from tests.support.screens import shot
from tests.support.service import chat_row, upload, wait_done, write_jsonl


def drop_file(page, target: str, path) -> None:
    """Drop `path` on `target` as a file dragged in from outside the browser would be."""
    transfer = page.evaluate_handle(
        """([name, text]) => { const dt = new DataTransfer();
                               dt.items.add(new File([text], name, { type: "application/jsonl" })); return dt; }""",
        [path.name, path.read_text()],
    )
    page.dispatch_event(target, "dragover", {"dataTransfer": transfer})
    page.dispatch_event(target, "drop", {"dataTransfer": transfer})


def test_create_watch_inspect_download(page, root_url, client, tmp_path):
    rows = [chat_row(f"req-{i}", f"say something about the number {i}", max_tokens=48) for i in range(40)]
    path = write_jsonl(tmp_path / "questions.jsonl", rows)
    page.goto(root_url + "/")
    page.evaluate("window.__sameDocument = true")  # gone if the page ever reloads
    page.get_by_role("link", name="New batch").first.click()
    expect(page.get_by_role("heading", name="New batch")).to_be_visible()
    drop_file(page, "#drop", path)  # dragged from the desktop onto the drop zone
    expect(page.locator("#file-name")).to_contain_text("questions.jsonl")
    page.get_by_label("Completion window").fill("2h")
    page.get_by_label("Metadata key 1").fill("project")
    page.get_by_label("Metadata value 1").fill("dash-test")
    shot(page, "new-batch")
    page.get_by_role("button", name="Create batch").click()

    expect(page).to_have_url(re.compile(r"#/batch/batch_"), timeout=30_000)
    batch_id = page.url.rsplit("/", 1)[-1]
    expect(page.locator("h1 .mono")).to_have_text(batch_id)
    expect(page.locator("h1 + .row .status")).to_have_text("completed", timeout=90_000)
    assert page.evaluate("window.__sameDocument") is True  # reached `completed` without a reload
    expect(page.locator("#metrics")).to_be_visible()
    charts = page.locator("#metrics svg.chart")
    expect(charts).to_have_count(6)
    lines = page.locator("#metrics svg.chart path.line")  # tokens/s, occupancy, batch size
    assert lines.count() == 3
    for i in range(3):  # drawn over the run, not a single point
        assert lines.nth(i).bounding_box()["width"] > 100
    assert page.locator("#metrics svg.chart rect.bar").count() >= 3  # TTFT, TPOT, queue wait
    expect(page.get_by_text("Slot efficiency").first).to_be_visible()
    expect(page.locator("dl.facts")).to_contain_text(["Created", "Output tokens"])
    health = page.locator("#output-health")  # what the answers are: 40 answered, each a finish reason
    expect(health).to_contain_text("Answers40")
    reasons = health.locator("dd").nth(1).inner_text()
    assert sum(int(n.replace(",", "")) for n in re.findall(r": ([\d,]+)", reasons)) == len(rows)
    shot(page, "batch")
    page.set_viewport_size({"width": 390, "height": 844})
    expect(page.get_by_role("link", name="Download output")).to_be_visible()
    shot(page, "batch-phone")
    page.set_viewport_size({"width": 1280, "height": 900})

    with page.expect_download() as info:
        page.get_by_role("link", name="Download output").click()
    saved = tmp_path / "out.jsonl"
    info.value.save_as(saved)
    lines = [json.loads(line) for line in saved.read_text().splitlines() if line.strip()]
    assert sorted(x["custom_id"] for x in lines) == sorted(r["custom_id"] for r in rows)
    assert client.batches.retrieve(batch_id).output_file_id
    assert client.files.content(client.batches.retrieve(batch_id).output_file_id).text == saved.read_text()
    with urllib.request.urlopen(f"{root_url}/v1/dashboard/batches/{batch_id}/timeline", timeout=10) as res:
        timeline = json.load(res)  # what the charts drew
    assert all(
        sum(timeline["histograms"][k]["counts"]) == len(rows) for k in ("ttft_s", "tpot_s", "queue_wait_s")
    )
    assert timeline["points"] and sum(p["steps"] for p in timeline["points"]) > 0

    page.get_by_role("link", name="Batches").first.click()
    row = page.locator(f"#batches tr[data-id='{batch_id}']")
    expect(row).to_contain_text("completed")
    expect(row).to_contain_text("project=dash-test")
    expect(row).to_contain_text("40 done · 0 failed · 40 total")
    page.get_by_label("Status").select_option("failed")
    expect(page).to_have_url(re.compile(r"status=failed"))
    expect(page.locator(f"#batches tr[data-id='{batch_id}']")).to_have_count(0)
    for status in page.locator("#batches tbody tr").evaluate_all("rows => rows.map(r => r.dataset.status)"):
        assert status == "failed"
    page.get_by_label("Status").select_option("completed")
    expect(page.locator(f"#batches tr[data-id='{batch_id}']")).to_have_count(1)


def test_cancel_a_running_batch_and_see_workers(page, root_url, client, tmp_path, engine_gate):
    # the held requests keep the batch running until it is cancelled; the others move its progress and ETA
    rows = [chat_row(f"long-{i}", f"{HOLD} a long answer {i}", max_tokens=128) for i in range(16)]
    rows += [chat_row(f"short-{i}", f"a short answer {i}", max_tokens=16) for i in range(240)]
    batch = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "long.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"kind": "long"},
    )
    page.goto(root_url + "/")
    row = page.locator(f"#batches tr[data-id='{batch.id}']")
    expect(row.locator(".status")).to_have_text("in progress", timeout=30_000)
    expect(row.get_by_role("progressbar")).to_be_visible()
    first_seen = row.locator(".progress-text").inner_text()
    expect(row.locator(".progress-text")).not_to_have_text(first_seen, timeout=30_000)  # refreshes itself
    expect(row.locator("td").nth(7)).to_have_text(re.compile(r"^≈ \d"), timeout=30_000)  # the ETA
    expect(row).to_contain_text("kind=long")
    wrap = page.locator(".table-wrap").first  # every column fits a laptop screen
    assert wrap.evaluate("w => w.scrollWidth <= w.clientWidth")
    shot(page, "batches")
    page.set_viewport_size({"width": 390, "height": 844})
    expect(row.locator(".status")).to_be_visible()
    shot(page, "batches-phone")
    page.set_viewport_size({"width": 1280, "height": 900})

    page.get_by_role("link", name="Workers").click()
    worker = page.locator("#workers tbody tr").first
    expect(worker).to_contain_text("bulkgen-worker-0")
    expect(worker).to_contain_text("bulkgen-tiny")
    expect(worker).to_contain_text(batch.id)
    expect(worker.locator(".progress-text")).to_have_text(re.compile(r"^[1-9]\d*% busy"), timeout=10_000)
    shot(page, "workers")

    worker.get_by_role("link", name=batch.id).click()
    expect(page.locator("h1 + .row .status")).to_have_text("in progress")
    page.get_by_role("button", name="Cancel batch").click()
    expect(page.locator("h1 + .row .status")).to_have_text("cancelled", timeout=60_000)
    expect(page.get_by_role("button", name="Cancel batch")).to_be_hidden()
    done = wait_done(client, batch.id)
    assert done.status == "cancelled" and done.request_counts.completed < len(rows)
    shot(page, "batch-cancelled")


def test_broken_file_shows_errors_with_lines(page, root_url, tmp_path):
    path = write_jsonl(
        tmp_path / "broken.jsonl",
        [
            chat_row("ok-1", "fine"),
            "{not json",
            {"method": "POST", "url": "/v1/chat/completions", "body": {}},
        ],
    )
    chosen = []
    page.on(
        "filechooser", lambda chooser: chosen.append(chooser)
    )  # intercept choosers from the start (enabling it later races)
    page.goto(root_url + "/#/new")
    page.get_by_role("button", name="Choose a file").focus()  # the keyboard alone: Enter opens the picker
    with page.expect_file_chooser() as chooser:
        page.keyboard.press("Enter")
    chooser.value.set_files(str(path))
    expect(page.locator("#file-name")).to_contain_text("broken.jsonl")
    page.get_by_role("button", name="Create batch").focus()
    page.keyboard.press("Enter")
    box = page.locator("#validation-errors")
    expect(box).to_contain_text("failed validation", timeout=30_000)
    table = box.locator("table.errors tbody")
    expect(table.locator("tr").filter(has_text="line 2")).to_contain_text("invalid_json_line")
    expect(table.locator("tr").filter(has_text="line 3")).to_contain_text("missing_custom_id")
    shot(page, "new-batch-errors")
    box.get_by_role("link").click()  # the failed batch's own page lists them too
    expect(page.locator("h1 + .row .status")).to_have_text("failed")
    expect(page.locator("table.errors")).to_contain_text("line 2")


def test_key_prompt(page, keyed_url, service, tmp_path):
    def status_of(path: str, key: str | None = None) -> int:
        req = urllib.request.Request(
            keyed_url + path, headers={"Authorization": f"Bearer {key}"} if key else {}
        )
        try:
            with urllib.request.urlopen(req, timeout=10) as res:
                return res.status
        except urllib.error.HTTPError as exc:
            return exc.code

    assert status_of("/") == 200 and status_of("/ui/app.js") == 200 and status_of("/ui/app.css") == 200
    assert status_of("/v1/dashboard/workers") == 401 and status_of("/v1/batches") == 401
    assert status_of("/v1/dashboard/workers", "dash-key") == 200

    page.goto(keyed_url + "/")
    dialog = page.get_by_role("dialog", name="API key")
    expect(dialog).to_be_visible()
    page.get_by_label("Key", exact=True).fill("wrong-key")
    page.keyboard.press("Enter")
    expect(dialog).to_contain_text("That key was refused")
    shot(page, "key-prompt")
    page.get_by_label("Key", exact=True).fill("dash-key")
    page.get_by_role("button", name="Use key").click()
    expect(dialog).to_be_hidden()
    expect(page.get_by_role("heading", name="Batches")).to_be_visible()
    expect(page.locator("#batches, #empty")).to_be_visible()
    keyed = [u for u in page.requests.urls if "/v1/" in u]
    assert keyed, "the page fetched no data"
    page.get_by_role("link", name="Workers").click()
    expect(page.locator("#workers")).to_contain_text("bulkgen-worker-0")  # the key is kept for later calls


def test_each_key_sees_only_its_tenant(page, tenants_url, client, tmp_path, engine_gate):
    """The page uses only /v1/... with the key, so a key sees its own tenant's batches and nothing else."""
    rows = [
        chat_row(f"t-{i}", f"{HOLD} tenant check {i}", max_tokens=64) for i in range(32)
    ]  # held on a worker
    own = client.batches.create(
        input_file_id=upload(client, write_jsonl(tmp_path / "own.jsonl", rows)).id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
    )
    page.goto(tenants_url + "/")
    page.get_by_label("Key", exact=True).fill("other-key")
    page.get_by_role("button", name="Use key").click()
    expect(page.locator("#empty")).to_have_text("No batches yet. Create one with New batch.")
    page.goto(f"{tenants_url}/#/batch/{own.id}")
    expect(page.get_by_role("alert")).to_contain_text("No such batch")
    page.goto(tenants_url + "/#/workers")
    expect(page.locator("#workers")).to_contain_text("bulkgen-worker-0")
    expect(page.locator("#workers")).not_to_contain_text(own.id)

    page.get_by_role("button", name="Forget key").click()
    page.get_by_label("Key", exact=True).fill("own-key")
    page.get_by_role("button", name="Use key").click()
    page.goto(tenants_url + "/#/workers")
    expect(page.locator("#workers")).to_contain_text(own.id, timeout=20_000)
    page.goto(tenants_url + "/")
    expect(page.locator(f"#batches tr[data-id='{own.id}']")).to_have_count(1)
    client.batches.cancel(own.id)
    wait_done(client, own.id)
