"""Nemotron-H (Mamba2, attention and MLP layers; two B/C groups, which shard over TP 2
where Granite's and Zamba2's single group is replicated) through real vLLM engines with
KVBridgeConnector: P/D equal to the decode engine's own run, negative control, prefill
killed before the pull, heterogeneous TP 2 -> 1 and 1 -> 2 (see
families.HeteroTPScenarios). vLLM's NixlConnector is not run as a reference here."""

from __future__ import annotations

import pytest
from families import HeteroTPScenarios

pytestmark = pytest.mark.timeout(1800)


class TestNemotronH(HeteroTPScenarios):
    family = "nemotronh"
    nixl_reference = False
