"""The policy bench on the real engine with a tiny model built from a config (no hub)."""

import json

import pytest

from bulkgen.lab.policy_bench import BenchInputError, compare_policies, format_comparison, load_requests
from bulkgen.lab.tiny import build_tiny_model, build_tokenizer


def write_batch(path, lines):
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


def chat(i, max_tokens):
    body = {
        "model": "m",
        "messages": [{"role": "user", "content": "hi " * (i + 1)}],
        "max_tokens": max_tokens,
    }
    return {"custom_id": f"c{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}


def completion(i, max_tokens):
    body = {"model": "m", "prompt": "abc" * (i + 1), "max_tokens": max_tokens, "temperature": 0}
    return {"custom_id": f"p{i}", "method": "POST", "url": "/v1/completions", "body": body}


def test_load_requests_tokenizes_chat_and_completions(tmp_path):
    tok = build_tokenizer()
    path = write_batch(
        tmp_path / "b.jsonl", [chat(0, 5), completion(1, 7), {**completion(2, 1), "body": {"prompt": "x"}}]
    )
    chat_req, comp_req, default_req = load_requests(path, tok)
    expected = tok.apply_chat_template(
        chat(0, 5)["body"]["messages"], add_generation_prompt=True, tokenize=False
    )
    assert chat_req.prompt_ids == tok(expected, add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids("<|assistant|>") in chat_req.prompt_ids
    assert (chat_req.max_tokens, chat_req.temperature) == (5, 1.0)
    assert comp_req.prompt_ids == tok("abcabc", add_special_tokens=False)["input_ids"]
    assert (comp_req.max_tokens, comp_req.temperature, comp_req.custom_id) == (7, 0.0, "p1")
    assert default_req.max_tokens == 16


@pytest.mark.parametrize(
    ("line", "words"),
    [
        ("{not json", r"b.jsonl:2: not valid JSON"),
        (json.dumps({**completion(0, 3), "url": "/v1/embeddings"}), r"b.jsonl:2: url must be one of"),
        (
            json.dumps({**completion(0, 3), "body": {"prompt": "x", "max_tokens": 0}}),
            r"b.jsonl:2: body.max_tokens",
        ),
        (json.dumps({**chat(0, 3), "body": {"messages": []}}), r"b.jsonl:2: body.messages"),
        (
            json.dumps({**completion(0, 3), "body": {"prompt": "x", "temperature": -1}}),
            r"b.jsonl:2: body.temperature",
        ),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, line, words):
    path = tmp_path / "b.jsonl"
    path.write_text(json.dumps(completion(0, 3)) + "\n" + line + "\n")
    with pytest.raises(BenchInputError, match=words):
        load_requests(path, build_tokenizer())


def test_empty_file(tmp_path):
    path = tmp_path / "b.jsonl"
    path.write_text("\n")
    with pytest.raises(BenchInputError, match="no requests"):
        load_requests(path, build_tokenizer())


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("model") / "tiny", seed=0)


def test_compare_policies_on_real_engine(tmp_path, tiny_model):
    # 8 requests, 2 slots, exact lengths: static runs groups to their longest member, so it pads.
    lengths = [2, 9, 3, 8, 2, 7, 4, 6]
    path = write_batch(tmp_path / "b.jsonl", [completion(i, n) for i, n in enumerate(lengths)])
    rows = compare_policies(tiny_model, path, ["static", "continuous"], max_num_seqs=2, ignore_eos=True)
    static, continuous = rows
    assert [r["policy"] for r in rows] == ["static", "continuous"]
    for row in rows:
        assert row["requests"] == 8 and row["output_tokens"] == sum(lengths)
        assert row["ttft_s"]["count"] == 8 and row["wall_time_s"] > 0
    assert static["speedup_vs_static"] == 1.0
    assert continuous["slot_efficiency"] == pytest.approx(1.0)
    assert continuous["decode_padding_pct"] == 0.0
    assert static["slot_efficiency"] < 1.0 and static["decode_padding_pct"] > 0
    table = format_comparison(rows)
    assert table.splitlines()[0].split()[:3] == ["policy", "wall", "s"]
    assert "continuous" in table and "1.00x" in table


def test_bad_max_num_seqs(tmp_path, tiny_model):
    path = write_batch(tmp_path / "b.jsonl", [completion(0, 2)])
    with pytest.raises(BenchInputError, match="max_num_seqs"):
        compare_policies(tiny_model, path, ["static"], max_num_seqs=0)
