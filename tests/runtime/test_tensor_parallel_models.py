"""Tensor parallel per served model on a real local Ray: `big` at --tensor-parallel big=2 (one worker of two
gloo ranks), `small` at 1 (one single-process worker), both the same random model. Each batch completes;
`big`'s text equals `small`'s line for line (greedy: the group gives the single engine's tokens), and each
batch's steps ran only on the workers of its model's rank count (its metrics, per worker, joined with the
dashboard's rank count of each worker)."""

from __future__ import annotations

import json
import urllib.request

from bulkgen.settings import Settings, WorkerSettings
from tests.support.service import Service, random_model, read_lines, upload, wait_done, write_jsonl

PROMPTS = ["item one", "the sea and", "Q: two plus two?", "Dear team,", "a b c", "x " * 9]


def _create(client, tmp_path, model: str):
    rows = [
        {
            "custom_id": f"{model}-{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": model, "prompt": p, "max_tokens": 8, "temperature": 0},
        }
        for i, p in enumerate(PROMPTS)
    ]
    file_id = upload(client, write_jsonl(tmp_path / f"{model}.jsonl", rows)).id
    return client.batches.create(input_file_id=file_id, endpoint="/v1/completions", completion_window="24h")


def _get(service, path: str) -> dict:
    return json.loads(urllib.request.urlopen(f"{service.base_url}{path}", timeout=30).read())


def _texts(client, batch) -> dict[int, str]:
    lines = read_lines(client, batch.output_file_id)
    return {int(x["custom_id"].rsplit("-", 1)[1]): x["response"]["body"]["choices"][0]["text"] for x in lines}


def test_a_model_at_two_ranks_beside_one_at_one_runs_on_its_own_workers(tmp_path):
    model = str(random_model())
    # the session service's engine settings: in the suite its worker 0 (same name) may be this pool's single one
    engine = {"max_num_seqs": 64, "max_num_batched_tokens": 1024, "collective_timeout_s": 30}
    workers = WorkerSettings(cpu_workers=1, engine_kwargs=engine, tensor_parallel={"big": 2})
    settings = Settings(
        storage=str(tmp_path / "store"), models={"big": model, "small": model}, range_size=2, workers=workers
    )
    service = Service(settings)
    try:
        client = service.client()
        big, small = _create(client, tmp_path, "big"), _create(client, tmp_path, "small")
        big, small = wait_done(client, big.id, timeout=300), wait_done(client, small.id, timeout=300)
        assert (big.status, small.status) == ("completed", "completed")
        assert big.request_counts.completed == small.request_counts.completed == len(PROMPTS)
        sharded, single = _texts(client, big), _texts(client, small)
        assert sharded == single and all(single.values())  # non-empty: equal empty strings prove nothing
        ranks = {w["id"]: w["tensor_parallel"] for w in _get(service, "/dashboard/workers")["data"]}
        assert sorted(ranks.values()) == [1, 2]
        for batch, count in ((big, 2), (small, 1)):
            ran_on = _get(service, f"/dashboard/batches/{batch.id}/timeline")["summary"]["per_worker"]
            assert ran_on and {ranks[w] for w in ran_on} == {count}, (batch.id, ran_on, ranks)
    finally:
        service.stop()
