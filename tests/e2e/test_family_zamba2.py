"""Zamba2 (full attention + two Mamba2 groups; the hybrid layers share one attention
block) through real vLLM engines with KVBridgeConnector: P/D equal to the decode engine's
own run (prompts of 20, 70 and 150 tokens), negative control, prefill killed before the
pull, and heterogeneous TP 2 -> 1 and 1 -> 2, where vLLM replicates the model's single
B/C group on both ranks (see families.HeteroTPScenarios). vLLM's NixlConnector, which
needs equal TP for Mamba hybrids, is not run as a reference here."""

from __future__ import annotations

import pytest
from families import HeteroTPScenarios

pytestmark = pytest.mark.timeout(1800)


class TestZamba2(HeteroTPScenarios):
    family = "zamba2"
    nixl_reference = False
