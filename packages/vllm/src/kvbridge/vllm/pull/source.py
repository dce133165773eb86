"""A pull-mode decode request's source: tokens to load and the checks, independent of vLLM.

vLLM asks the connector how many prompt tokens beyond the locally computed
ones it can load (``get_num_new_matched_tokens``). For a decode request whose
KV comes from a prefill engine the answer covers every prompt token but the
last: the decode engine computes the last prompt token itself in any case (it
needs that token's logits to sample; vLLM >= 0.32 recomputes it even when a
load covered it), so reading its KV would be wasted. That makes a full
prefix-cache hit possible: when the decode engine's cache already holds the
first ``n - 1`` tokens of an ``n``-token prompt, nothing is loaded and the
prefill engine's blocks are released at once. A prefill engine of an older
vLLM that computed fewer tokens says so in ``remote_num_tokens``.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvbridge.topology import blocks_for_tokens
from kvbridge.vllm.params import ParamsError, RemotePrefill

__all__ = ["check_remote_blocks", "check_remote_groups", "check_remote_parallelism", "tokens_to_load"]


def tokens_to_load(rp: RemotePrefill, num_prompt_tokens: int, num_computed_tokens: int) -> int:
    """Prompt tokens to load from ``rp``'s prefill engine beyond the ``num_computed_tokens``
    already present locally: the prompt but its last token (which the decode engine
    computes itself), or fewer when the prefill engine says it computed fewer. 0 when
    the local prefix covers that much (a full prefix-cache hit)."""
    if num_prompt_tokens < 0 or num_computed_tokens < 0:
        raise ValueError(f"token counts must be >= 0, got {num_prompt_tokens}, {num_computed_tokens}")
    target = max(num_prompt_tokens - 1, 0)
    if rp.num_tokens is not None:
        target = min(rp.num_tokens, target)
    return max(target - num_computed_tokens, 0)


def check_remote_blocks(rp: RemotePrefill, num_prompt_tokens: int, remote_block_size: int,
                        group_kinds: Sequence[str] = ()) -> None:
    """Refuse parameters whose block lists cannot hold the prompt.

    Every attention group of the prefill engine must list enough blocks of
    ``remote_block_size`` tokens for the tokens it computed (``remote_num_tokens``,
    else ``num_prompt_tokens``: the prompt decode received); a Mamba group (kind
    ``"mamba"`` in ``group_kinds``) must list at least one block (the state after
    those tokens). Fewer means the parameters belong to another prompt or were
    truncated, and pulling them would decode from garbage.
    """
    if rp.num_tokens is not None and rp.num_tokens < num_prompt_tokens - 1:
        raise ParamsError(
            f"prefill computed {rp.num_tokens} tokens but the decode prompt has "
            f"{num_prompt_tokens}: the kv_transfer_params belong to another prompt"
        )
    tokens = num_prompt_tokens if rp.num_tokens is None else min(rp.num_tokens, num_prompt_tokens)
    need = blocks_for_tokens(tokens, remote_block_size)
    for g, blocks in enumerate(rp.block_ids):
        mamba = g < len(group_kinds) and group_kinds[g] == "mamba"
        want, unit = (1, "block (the Mamba state)") if mamba else (
            need, f"blocks of {remote_block_size} tokens")
        if len(blocks) < want:
            raise ParamsError(
                f"remote_block_ids group {g} lists {len(blocks)} blocks, the prompt of "
                f"{tokens} tokens needs {want} {unit}"
            )


def check_remote_groups(rp: RemotePrefill, group_kinds: Sequence[str]) -> None:
    """Refuse parameters whose number of KV-cache groups differs from this engine's
    (``group_kinds``; empty: one group): the prefill engine serves another model or
    another KV-cache grouping."""
    want = max(len(group_kinds), 1)
    if len(rp.block_ids) != want:
        what = ", ".join(group_kinds) if group_kinds else "full"
        raise ParamsError(
            f"remote_block_ids holds {len(rp.block_ids)} KV-cache group(s) but this engine has "
            f"{want} ({what}); both engines must serve the same model with the same KV-cache "
            "grouping (for hybrid models: a vLLM with the hybrid KV-cache manager on both sides)"
        )


def check_remote_parallelism(rp: RemotePrefill) -> None:
    """Refuse parameters of a prefill engine that splits KV by pipeline or decode-context
    parallelism (only tensor parallelism is transferred)."""
    for key, size in (("pp_size", rp.pp_size), ("dcp_size", rp.dcp_size)):
        if size != 1:
            raise ParamsError(
                f"they come from a prefill engine with {key}={size}; kvbridge transfers KV "
                "caches split by tensor parallelism only: run the prefill engine with "
                "pipeline_parallel_size=1 and decode_context_parallel_size=1"
            )
