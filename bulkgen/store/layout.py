"""The storage layout: every key and prefix bulkgen reads or writes is named here, and only here.

Keys are relative to a store. A tenant's objects sit under its root: the storage root itself for the
default tenant, `tenants/<name>/` for every other one (`BatchService.store`); a few objects are shared by
all tenants and sit at the storage root only (`BatchService.root`).

Under a tenant's root:

  files/meta/<file>.json                        the file object
  files/data/<file>                             its bytes
  files/refs/<file>/<batch>                     {"created_at"}: this batch reads the file (fileuse)
  files/use/<file>.json                         {"pins", "deleting"}: orders batch creation against delete
  batches/<batch>.json                          the batch object (conditional writes)
  parts/<batch>/lines-<first>-<last>.jsonl      a result part, lines first..last (9 digits each)
  parts/<batch>/runner-<owner>.json             {"owner", "started_at"}: who ran the batch
  leases/<batch>.json                           {"owner", "expires_at"}: the runner's lease
  reports/<batch>/<name>                        report.json, report.png, metrics-state.json
  watch/claims/<h>.json                         a watcher's claim on one input object version
  watch/done/<h>                                empty: that object version is finished

At the storage root only:

  tenants/<name>/                               the root of every tenant but the default one
  active/<batch>, active/<tenant>/<batch>       empty: the batch has not ended (index of all tenants)
  meta/totals.json                              running totals of ended batches (/metrics)
  profiles/<model>/<device>.json                a model's measured step costs on one device (plan)
  webhooks/pending/<event>.json                 a webhook event not yet delivered

Stored result files are named `<batch>_output.jsonl` and `<batch>_error.jsonl`, as the hosted API names them.

Ids are checked against their pattern by the repositories before they reach these functions
(bulkgen.batch.records); the functions only spell keys, and parse the keys they spelled.
"""

from __future__ import annotations

import re

FILES_META = "files/meta/"
FILES_DATA = "files/data/"
FILES_REFS = "files/refs/"
FILES_USE = "files/use/"
BATCHES = "batches/"
PARTS = "parts/"
LEASES = "leases/"
REPORTS = "reports/"
WATCH_CLAIMS = "watch/claims/"
WATCH_DONE = "watch/done/"
TENANTS = "tenants/"
TENANT_PATTERN = r"[a-z0-9][a-z0-9_-]{0,62}"  # a tenant name (bulkgen.tenants.check_tenant)
ACTIVE = "active/"
TOTALS = "meta/totals.json"
PROFILES = "profiles/"
WEBHOOKS_PENDING = "webhooks/pending/"

LINES = "lines-"
RUNNER = "runner-"
METRICS_STATE = "metrics-state.json"
_PART = re.compile(r"/lines-(\d{9})-(\d{9})\.jsonl$")


# -- files ----------------------------------------------------------------------------------------------
def file_meta(file_id: str) -> str:
    return f"{FILES_META}{file_id}.json"


def file_data(file_id: str) -> str:
    return f"{FILES_DATA}{file_id}"


def file_refs(file_id: str) -> str:
    """The prefix of every ref to the file (one key per batch that reads it)."""
    return f"{FILES_REFS}{file_id}/"


def file_ref(file_id: str, batch_id: str) -> str:
    return file_refs(file_id) + batch_id


def file_use(file_id: str) -> str:
    return f"{FILES_USE}{file_id}.json"


def ref_batch(ref_key: str) -> str:
    """files/refs/<file>/<batch> -> <batch>."""
    return ref_key.rsplit("/", 1)[-1]


def output_filename(batch_id: str) -> str:
    """The stored name of a batch's output file."""
    return f"{batch_id}_output.jsonl"


def error_filename(batch_id: str) -> str:
    """The stored name of a batch's error file (the dashboard downloads it under the same name)."""
    return f"{batch_id}_error.jsonl"


# -- batches --------------------------------------------------------------------------------------------
def batch(batch_id: str) -> str:
    return f"{BATCHES}{batch_id}.json"


def batch_id_of(record_key: str) -> str:
    """batches/<batch>.json -> <batch>."""
    return record_key.removeprefix(BATCHES).removesuffix(".json")


def parts(batch_id: str) -> str:
    """The prefix of every part and runner note of the batch."""
    return f"{PARTS}{batch_id}/"


def part_lines(batch_id: str) -> str:
    """The prefix of the batch's result parts (not its runner notes)."""
    return f"{parts(batch_id)}{LINES}"


def part(batch_id: str, first_line: int, last_line: int) -> str:
    return f"{part_lines(batch_id)}{first_line:09d}-{last_line:09d}.jsonl"


def part_range(key: str) -> tuple[int, int] | None:
    """parts/<batch>/lines-<first>-<last>.jsonl -> (first, last); None for any other key."""
    match = _PART.search(key)
    return (int(match.group(1)), int(match.group(2))) if match else None


def runner_note(batch_id: str, owner: str) -> str:
    return f"{parts(batch_id)}{RUNNER}{owner}.json"


def parts_batch(key: str) -> str:
    """parts/<batch>/<name> -> <batch>."""
    return key.removeprefix(PARTS).split("/", 1)[0]


def is_runner_note(key: str) -> bool:
    return key.rsplit("/", 1)[-1].startswith(RUNNER)


def lease(batch_id: str) -> str:
    return f"{LEASES}{batch_id}.json"


def lease_batch(key: str) -> str:
    """leases/<batch>.json -> <batch>."""
    return key.removeprefix(LEASES).removesuffix(".json")


def report(batch_id: str, name: str) -> str:
    return f"{REPORTS}{batch_id}/{name}"


def metrics_state(batch_id: str) -> str:
    """The runner's metrics state (bounded sketches and a timeline, a few KB): kept after the batch ends,
    beside its report, for the dashboard's charts."""
    return report(batch_id, METRICS_STATE)


# -- the active index (storage root) ------------------------------------------------------------------
def active(batch_id: str, tenant: str = "") -> str:
    """The batch's entry in the active index; `tenant` '' for the default tenant (whose entries have no
    folder)."""
    return f"{ACTIVE}{tenant}/{batch_id}" if tenant else f"{ACTIVE}{batch_id}"


def active_entry(key: str) -> tuple[str, str]:
    """active/[<tenant>/]<batch> -> (tenant or '', batch)."""
    tenant, _, batch_id = key.removeprefix(ACTIVE).rpartition("/")
    return tenant, batch_id


# -- tenants (storage root) ---------------------------------------------------------------------------
def tenant_root(name: str) -> str:
    """The folder of a non-default tenant's objects (no trailing slash: `Store.sub` takes it as is)."""
    return f"{TENANTS}{name}"


def tenant_names(keys) -> set[str]:
    """The tenants that own objects, from a listing of TENANTS."""
    return {key.split("/")[1] for key in keys if key.count("/") >= 2}


# -- watcher claims -------------------------------------------------------------------------------------
def watch_claim(name: str) -> str:
    return f"{WATCH_CLAIMS}{name}.json"


def watch_done(name: str) -> str:
    return f"{WATCH_DONE}{name}"


def watch_done_name(key: str) -> str:
    return key.removeprefix(WATCH_DONE)


# -- profiles and webhooks (storage root) -------------------------------------------------------------
def model_profiles(model: str) -> str:
    return f"{PROFILES}{model}/"


def profile(model: str, device: str) -> str:
    return f"{model_profiles(model)}{device}.json"


def profile_device(key: str) -> str:
    """profiles/<model>/<device>.json -> <device>."""
    return key.rsplit("/", 1)[-1].removesuffix(".json")


def webhook_pending(event_id: str) -> str:
    return f"{WEBHOOKS_PENDING}{event_id}.json"
