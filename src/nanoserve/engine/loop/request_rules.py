"""The rules the scheduler reads off one request: is it still prefilling, does the token the
device owes it end it (stage 11), and why a token finishes it. Pure functions of a Sequence;
the scheduler (scheduler.py, batch_selection.py) is what acts on them.
"""

from __future__ import annotations

from nanoserve.types import Sequence


def is_prefilling(seq: Sequence) -> bool:
    """True for a running sequence whose prompt is only partly computed (chunked prefill).

    A decode-ready sequence lacks K/V for exactly one token, its newest; one that lacks more is
    still prefilling. (Lacking exactly one is also the last chunk of a prefill: a decode step
    computes it the same way, and samples from it.)
    """
    return len(seq) - seq.num_cached_tokens > 1


def owes_its_last_token(seq: Sequence, max_model_len: int, ahead: int = 0) -> bool:
    """Stage 11: True when the token the device owes seq ends it by length: no step may follow.
    Stage 12: or may end it, when the step in flight may also keep up to `ahead` guesses."""
    if seq.num_pending == 0:
        return False
    completion = seq.num_completion_tokens + seq.num_pending + ahead
    return completion >= seq.params.max_tokens or len(seq) + ahead >= max_model_len


def finish_reason(seq: Sequence, token_id: int, eos_ids, max_model_len: int) -> str | None:
    """ "stop" on an EOS or stop token, "length" at max_tokens or max_model_len, else None."""
    params = seq.params
    if token_id in params.stop_token_ids or (not params.ignore_eos and token_id in eos_ids):
        return "stop"
    if seq.num_completion_tokens >= params.max_tokens or len(seq) >= max_model_len:
        return "length"
    return None
