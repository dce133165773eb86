"""GraniteMoeHybrid (Mamba2 + attention) through real vLLM engines: vLLM's NixlConnector as
the reference, then KVBridgeConnector on the same tiny model and prompts (20, 70 and 150
tokens: longer than the Mamba chunk), negative control, prefill killed before the pull,
and heterogeneous TP 2 -> 1 and 1 -> 2 (see families.FamilyScenarios)."""

from __future__ import annotations

import pytest
from families import HeteroTPScenarios

pytestmark = pytest.mark.timeout(1800)


class TestGraniteHybrid(HeteroTPScenarios):
    family = "granite"
