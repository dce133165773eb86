"""Scheduler-side arithmetic of a remote prefill, independent of vLLM.

vLLM asks the connector how many prompt tokens beyond the locally computed
ones it can load (``get_num_new_matched_tokens``). For a decode request whose
KV comes from a prefill engine the answer covers the prompt; vLLM 0.32's
scheduler itself recomputes the last prompt token when the load covered the
whole prompt (it needs that token's logits to sample), and older vLLM versions
expected the connector to leave the last token out. Both conventions are
supported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvbridge.vllm.params import ParamsError, RemotePrefill, is_remote_prefill

__all__ = ["blocks_for_tokens", "check_remote_blocks", "matched_tokens", "tokens_to_load"]


def blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks of ``block_size`` tokens needed to hold ``num_tokens``."""
    if block_size < 1 or num_tokens < 0:
        raise ValueError(f"need block_size >= 1 and num_tokens >= 0, got {block_size}, {num_tokens}")
    return -(-num_tokens // block_size)


def tokens_to_load(num_prompt_tokens: int, num_computed_tokens: int, *,
                   include_last_token: bool = True) -> int:
    """Prompt tokens to pull beyond the ``num_computed_tokens`` already local.

    ``include_last_token=False`` leaves the last prompt token to be computed
    locally (the convention before vLLM's scheduler did that itself).
    """
    if num_prompt_tokens < 0 or num_computed_tokens < 0:
        raise ValueError("token counts must be >= 0")
    target = num_prompt_tokens if include_last_token else max(num_prompt_tokens - 1, 0)
    return max(target - num_computed_tokens, 0)


def matched_tokens(params: Mapping[str, Any] | None, num_prompt_tokens: int,
                   num_computed_tokens: int, *, include_last_token: bool = True) -> tuple[int, bool]:
    """The ``(count, load_async)`` answer to vLLM's ``get_num_new_matched_tokens``.

    ``(0, False)`` for requests without remote prefill parameters or with
    nothing left to load; otherwise ``(count, True)``: the load is asynchronous.
    """
    if not is_remote_prefill(params):
        return 0, False
    n = tokens_to_load(num_prompt_tokens, num_computed_tokens,
                       include_last_token=include_last_token)
    return (n, True) if n > 0 else (0, False)


def check_remote_blocks(rp: RemotePrefill, num_prompt_tokens: int, remote_block_size: int) -> None:
    """Refuse parameters whose block lists cannot hold the prompt.

    Every KV-cache group of the prefill engine must list enough blocks of
    ``remote_block_size`` tokens for ``num_prompt_tokens`` (the prompt decode
    received); fewer means the parameters belong to another prompt or were
    truncated, and pulling them would decode from garbage.
    """
    need = blocks_for_tokens(num_prompt_tokens, remote_block_size)
    if rp.num_tokens is not None and rp.num_tokens < num_prompt_tokens - 1:
        raise ParamsError(
            f"prefill computed {rp.num_tokens} tokens but the decode prompt has "
            f"{num_prompt_tokens}: the kv_transfer_params belong to another prompt"
        )
    for g, blocks in enumerate(rp.block_ids):
        if len(blocks) < need:
            raise ParamsError(
                f"remote_block_ids group {g} lists {len(blocks)} blocks, the prompt of "
                f"{num_prompt_tokens} tokens needs {need} blocks of {remote_block_size} tokens"
            )
