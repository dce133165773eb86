"""Host staging buffers for device memory NIXL cannot register.

The host mirror has the same regions, block strides and element geometry as
the device cache, so descriptors built on ``staging.regions`` address the same
blocks. Copies move whole logical blocks (all kernel blocks, K and V, Mamba
state) of the given ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from .errors import MemoryLayoutError
from .regions import CacheRegions


@dataclass(frozen=True, eq=False)
class HostStaging:
    """A host (DRAM) mirror of a device cache: register and describe ``regions``."""

    device: CacheRegions
    regions: CacheRegions
    buffers: tuple[torch.Tensor, ...] = field(repr=False)

    @classmethod
    def allocate(cls, device: CacheRegions, pin_memory: bool | None = None) -> HostStaging:
        """Allocate host buffers mirroring ``device`` (pinned when CUDA is available)."""
        if pin_memory is None:
            pin_memory = torch.cuda.is_available()
        buffers = []
        regs = []
        for reg in device.regions:
            buf = torch.empty((reg.num_blocks, reg.block_stride), dtype=torch.uint8,
                              pin_memory=pin_memory)
            buffers.append(buf)
            regs.append(replace(reg, base_addr=buf.data_ptr(), device_id=0, mem_type="DRAM"))
        host = replace(device, regions=tuple(regs), device_id=0, mem_type="DRAM",
                       anchors=tuple(buffers))
        return cls(device=device, regions=host, buffers=tuple(buffers))

    def _ids(self, block_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.device.num_blocks):
            raise MemoryLayoutError(
                f"block ids outside the {self.device.num_blocks} blocks of the cache"
            )
        return ids

    def to_host(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Copy blocks ``block_ids`` device -> host (before sending them)."""
        ids = self._ids(block_ids)
        if len(ids) == 0:
            return
        for i, buf in enumerate(self.buffers):
            dev = self.device.byte_view(i)
            idx = torch.as_tensor(ids, device=dev.device)
            buf.index_copy_(0, torch.as_tensor(ids), dev.index_select(0, idx).cpu())

    def to_device(self, block_ids: Sequence[int] | np.ndarray) -> None:
        """Copy blocks ``block_ids`` host -> device (after receiving them)."""
        ids = self._ids(block_ids)
        if len(ids) == 0:
            return
        for i, buf in enumerate(self.buffers):
            dev = self.device.byte_view(i)
            idx = torch.as_tensor(ids, device=dev.device)
            rows = buf.index_select(0, torch.as_tensor(ids)).to(dev.device)
            dev.index_copy_(0, idx, rows)
