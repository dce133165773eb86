"""Pull mode: tokens to load and checks of a remote prefill (kvbridge.vllm.pull.source)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvbridge.vllm.params import ParamsError, RemotePrefill
from kvbridge.vllm.pull.source import check_remote_blocks, check_remote_parallelism, tokens_to_load


def _rp(blocks: tuple[tuple[int, ...], ...] = ((1,),), num_tokens: int | None = 70,
        **wire: object) -> RemotePrefill:
    return RemotePrefill.of(engine_id="P", host="h", port=1, request_id="r", block_ids=blocks,
                            num_tokens=num_tokens, **wire)


def test_the_prompt_but_its_last_token_is_loaded() -> None:
    rp = _rp(num_tokens=70)
    assert tokens_to_load(rp, 70, 0) == 69  # decode computes token 70 itself
    assert tokens_to_load(rp, 70, 64) == 5  # local prefix-cache hit
    assert tokens_to_load(rp, 70, 70) == 0
    assert tokens_to_load(_rp(num_tokens=1), 1, 0) == 0  # one-token prompt: nothing to read


def test_a_local_prefix_of_all_but_the_last_token_is_a_full_hit() -> None:
    # 129 = 4 blocks of 32 + 1: the prefix cache holds the first 128 tokens, the
    # 129th is computed locally anyway, so nothing is read (and the prefill is released)
    assert tokens_to_load(_rp(num_tokens=129), 129, 128) == 0
    assert tokens_to_load(_rp(num_tokens=129), 129, 96) == 32
    assert tokens_to_load(_rp(num_tokens=97), 97, 96) == 0


def test_an_older_prefill_engine_that_left_the_last_token_out_is_followed() -> None:
    assert tokens_to_load(_rp(num_tokens=69), 70, 0) == 69
    assert tokens_to_load(_rp(num_tokens=68), 70, 0) == 68
    assert tokens_to_load(_rp(num_tokens=None), 70, 0) == 69  # unknown: all but the last token
    with pytest.raises(ValueError):
        tokens_to_load(_rp(), -1, 0)


@given(st.integers(0, 5000), st.integers(0, 5000), st.one_of(st.none(), st.integers(0, 5000)))
def test_loaded_plus_computed_never_exceeds_prompt_or_prefill(n: int, c: int, p: int | None) -> None:
    k = tokens_to_load(_rp(num_tokens=p), n, c)
    assert k >= 0
    if k:
        assert c + k == (max(n - 1, 0) if p is None else min(max(n - 1, 0), p))
        assert c + k < n  # the last prompt token is never loaded


def test_check_remote_blocks() -> None:
    check_remote_blocks(_rp(((1, 2, 3),)), 70, 32)  # 3 blocks hold 70 tokens
    check_remote_blocks(_rp(((1, 2, 3), (4, 5, 6)), num_tokens=96), 96, 32)
    with pytest.raises(ParamsError, match="group 1 lists 2 blocks"):
        check_remote_blocks(_rp(((1, 2, 3), (4, 5))), 70, 32)
    with pytest.raises(ParamsError, match="another prompt"):
        check_remote_blocks(_rp(((1, 2, 3, 4, 5, 6, 7),), num_tokens=70), 200, 32)
    # Larger remote blocks: 70 tokens fit in 2 blocks of 64.
    check_remote_blocks(_rp(((8, 9),)), 70, 64)


def test_check_remote_parallelism() -> None:
    check_remote_parallelism(_rp())
    with pytest.raises(ParamsError, match="pp_size=2"):
        check_remote_parallelism(_rp(pp_size=2))
    with pytest.raises(ParamsError, match="dcp_size=3"):
        check_remote_parallelism(_rp(dcp_size=3))
