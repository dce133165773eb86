"""Scheduler-side arithmetic of a remote prefill."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.vllm.params import ParamsError, RemotePrefill, prefill_request_params
from kvbridge.vllm.scheduling import (
    blocks_for_tokens,
    check_remote_blocks,
    matched_tokens,
    tokens_to_load,
)

REMOTE = {"do_remote_prefill": True}


def _rp(blocks: tuple[tuple[int, ...], ...], num_tokens: int | None = 70) -> RemotePrefill:
    return RemotePrefill(engine_id="P", host="h", port=1, request_id="r", block_ids=blocks,
                         num_tokens=num_tokens)


def test_blocks_for_tokens() -> None:
    assert [blocks_for_tokens(n, 32) for n in (0, 1, 32, 33, 96, 200)] == [0, 1, 1, 2, 3, 7]
    with pytest.raises(ValueError):
        blocks_for_tokens(5, 0)


def test_vllm_032_convention_loads_the_whole_prompt() -> None:
    assert matched_tokens(REMOTE, 70, 0) == (70, True)
    assert matched_tokens(REMOTE, 70, 64) == (6, True)  # local prefix-cache hit
    assert matched_tokens(REMOTE, 70, 70) == (0, False)


def test_older_convention_leaves_the_last_token() -> None:
    assert matched_tokens(REMOTE, 70, 0, include_last_token=False) == (69, True)
    assert matched_tokens(REMOTE, 1, 0, include_last_token=False) == (0, False)


def test_requests_without_remote_prefill_load_nothing() -> None:
    assert matched_tokens(None, 70, 0) == (0, False)
    assert matched_tokens(prefill_request_params(), 70, 0) == (0, False)
    assert matched_tokens({"do_remote_prefill": False}, 70, 0) == (0, False)


@given(st.integers(0, 5000), st.integers(0, 5000), st.booleans())
def test_loaded_plus_computed_never_exceeds_prompt(n: int, c: int, last: bool) -> None:
    k = tokens_to_load(n, c, include_last_token=last)
    assert k >= 0
    if k:
        assert c + k == (n if last else n - 1)


def test_check_remote_blocks() -> None:
    check_remote_blocks(_rp(((1, 2, 3),)), 70, 32)  # 3 blocks hold 70 tokens
    check_remote_blocks(_rp(((1, 2, 3), (4, 5, 6)), num_tokens=96), 96, 32)
    with pytest.raises(ParamsError, match="group 1 lists 2 blocks"):
        check_remote_blocks(_rp(((1, 2, 3), (4, 5))), 70, 32)
    with pytest.raises(ParamsError, match="another prompt"):
        check_remote_blocks(_rp(((1, 2, 3, 4, 5, 6, 7),), num_tokens=70), 200, 32)
    # Larger remote blocks: 70 tokens fit in 2 blocks of 64.
    check_remote_blocks(_rp(((8, 9),)), 70, 64)
