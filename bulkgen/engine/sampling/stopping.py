"""When a sequence stops, and what text it returns."""

from __future__ import annotations

from bulkgen.engine.sequence import Sequence


def check_stop(seq: Sequence, tokenizer) -> bool:
    """Set `seq.finish_reason` ("stop" or "length") and return True once the last token ends it.

    EOS and stop ids are one lookup in the request's precomputed stop set; only stop strings decode."""
    params, token = seq.params, seq.token_ids[-1]
    if token in seq.request.stop_ids:
        seq.finish_reason = "stop"
        return True
    if params.stop and _stop_in_tail(seq, tokenizer):
        text = tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        hits = [i for i in (text.find(s) for s in params.stop) if i >= 0]
        if hits:
            seq.stop_text = text[: min(hits)]
            seq.finish_reason = "stop"
            return True
    if len(seq.token_ids) - seq.num_prompt_tokens >= seq.max_tokens:  # num_output_tokens, minus a call
        seq.finish_reason = "length"
        return True
    return False


def completion_text(seq: Sequence, tokenizer) -> str:
    """Decoded output; ends before the stop string when one matched."""
    if seq.stop_text is not None:
        return seq.stop_text
    return tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)


def _stop_in_tail(seq: Sequence, tokenizer) -> bool:
    """Cheap per-token check on the last few tokens only, so long outputs do not cost O(n^2) decoding."""
    window = 4 * max(len(s) for s in seq.params.stop) + 8
    tail = tokenizer.decode(seq.output_token_ids[-window:], skip_special_tokens=True)
    return any(s in tail for s in seq.params.stop)
