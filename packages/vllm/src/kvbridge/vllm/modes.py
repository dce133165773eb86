"""Pull or push, chosen once per engine: the interface each mode implements per role.

vLLM runs the connector in two roles: one scheduler half in the engine core and
one worker half per TP rank. Each transfer mode implements both, in its own
package: :mod:`kvbridge.vllm.pull` (the decode engine reads the prefill engine's
blocks) and :mod:`kvbridge.vllm.push` (the prefill engine writes into blocks the
decode engine allocated). The connector builds the halves of its configured mode
once (:mod:`kvbridge.vllm.halves`) and every hook forwards to them; nothing else
asks which mode it is in.

The scheduler half (:class:`SchedulerMode`) takes plain values read from vLLM's
objects and returns, once per step, the orders its workers carry out (pickled to
every worker); the worker half (:class:`WorkerMode`, implemented on
:class:`kvbridge.vllm.rank_engines.RankEngines`) carries them out with the rank's
transfer engines and reports what finished.

This module imports nothing from vLLM, torch or NIXL.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from kvbridge.topology import BlockIds

if TYPE_CHECKING:  # kvbridge.handshake imports ZMQ; this module stays free of it
    from kvbridge.handshake import OfferHandler

__all__ = [
    "Allocated",
    "Allocation",
    "BlockIds",
    "Orders",
    "SchedulerMode",
    "StepProgress",
    "TransferResults",
    "WorkerMode",
]

#: one scheduled request of a step: (id, tokens computed before the step, tokens scheduled
#: in it, newly allocated block ids per group or None)
StepProgress = tuple[str, int, int, BlockIds | None]


class Allocation(Protocol):
    """A request's blocks once vLLM allocated them (``update_state_after_alloc``), per
    transfer group. :class:`kvbridge.vllm.shims.VllmAllocation` reads them from vLLM's
    ``KVCacheBlocks`` on first use; :class:`Allocated` holds them as values."""

    @property
    def block_ids(self) -> BlockIds:
        """Every block of the request."""

    @property
    def new_block_ids(self) -> BlockIds:
        """The blocks a load writes: those after the leading prefix-cache hits (a
        sliding-window group keeps its null blocks, a Mamba group its whole list)."""

    @property
    def prefix_hits(self) -> int:
        """Leading prefix-cache hits, in blocks, as the pull load counts them: the most any
        full-attention group has (0 without a full-attention group)."""

    @property
    def first_group_hits(self) -> int:
        """Leading prefix-cache hits of the first group, in blocks (push: one group)."""


@dataclass(frozen=True)
class Allocated:
    """An :class:`Allocation` given as values (tests, other engines)."""

    block_ids: BlockIds = ()
    new_block_ids: BlockIds = ()
    prefix_hits: int = 0
    first_group_hits: int = 0


class Orders(Protocol):
    """One step's orders of a mode (pickled to every worker)."""

    @property
    def empty(self) -> bool:
        """Nothing to do this step."""


class SchedulerMode(ABC):
    """The scheduler half of a mode: per-request bookkeeping, one set of orders per step.

    ``params`` is the request's ``kv_transfer_params`` as vLLM holds it; a mode parses
    it once per request (:mod:`kvbridge.vllm.params`) and never changes it.
    """

    #: the side channel's push-offer handler (push mode), None when the mode takes none
    offer_handler: OfferHandler | None = None

    @abstractmethod
    def on_new_request(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int) -> bool:
        """A request was added; True when the connector must drop its last prompt token
        (a prefill request for a remote decode on a Mamba hybrid)."""

    @abstractmethod
    def matched_tokens(self, request_id: str, params: Mapping[str, Any] | None,
                       num_prompt_tokens: int, num_computed_tokens: int) -> tuple[int | None, bool]:
        """vLLM's ``get_num_new_matched_tokens``: (tokens to load beyond the computed ones,
        asynchronously?); None: ask again later."""

    @abstractmethod
    def after_alloc(self, request_id: str, params: Mapping[str, Any] | None,
                    num_prompt_tokens: int, blocks: Allocation, num_external_tokens: int) -> None:
        """vLLM's ``update_state_after_alloc`` (possibly twice per request)."""

    @abstractmethod
    def take_orders(self, progress: Sequence[StepProgress] = ()) -> Orders:
        """This step's orders (``progress``: the step's scheduled requests); resets them."""

    @abstractmethod
    def finished(self, request_id: str, params: Mapping[str, Any] | None, *, completed: bool,
                 block_ids: BlockIds, num_computed_tokens: int, num_prompt_tokens: int
                 ) -> tuple[bool, dict[str, Any] | None]:
        """vLLM's ``request_finished``: (keep the blocks until a worker reports the request
        sent?, ``kv_transfer_params`` for the output). ``completed``: finished normally
        (length or stop), not aborted or failed."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """These requests' transfers finished (vLLM's merged worker results)."""
        return

    @property
    def pending(self) -> bool:
        """Work waiting that needs vLLM to keep stepping (``has_pending_push_work``)."""
        return False

    @abstractmethod
    def set_served(self, incarnation: str, facts: Mapping[str, Any]) -> None:
        """The side channel serves this engine's metadata now: its ``incarnation`` and the
        cache facts a push accept names (``block_size``, ``kernel_blocks_per_block``,
        ``head_order``)."""

    def close(self) -> None:
        """Stop what the mode runs in the background."""
        return


@dataclass(frozen=True)
class TransferResults:
    """What one rank reports between two steps."""

    #: prefill requests whose held blocks vLLM may free now (read, lapsed, or not holdable)
    finished_sending: frozenset[str] = frozenset()
    #: decode requests whose load ended, successfully or not
    finished_recving: frozenset[str] = frozenset()
    #: the subset of ``finished_recving`` whose load failed
    failed_recving: frozenset[str] = frozenset()

    @property
    def empty(self) -> bool:
        """Nothing ended."""
        return not (self.finished_sending or self.finished_recving or self.failed_recving)


class WorkerMode(ABC):
    """The worker half of a mode: carries out each step's orders on one TP rank.

    vLLM 0.32 binds a step's orders before the forward pass, calls
    :meth:`save_layer` inside it (per attention layer), then :meth:`start` and
    :meth:`finish_saves`, then asks for the results.
    """

    @abstractmethod
    def start(self, orders: Orders) -> None:
        """Carry out one step's orders; never waits for a peer."""

    @abstractmethod
    def save_layer(self, layer_name: str, orders: Orders) -> None:
        """Inside the forward pass, once vLLM wrote ``layer_name`` of this step."""

    @abstractmethod
    def finish_saves(self, orders: Orders) -> None:
        """After the forward pass: write what the step's saves did not."""

    @abstractmethod
    def results(self, wait_s: float = 0.0) -> TransferResults:
        """Requests whose transfer ended on this rank since the last call; with ``wait_s``
        (an idle step), wait up to that long for one while transfers are in flight."""
