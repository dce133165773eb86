"""Gemma3 (sliding window of 32 + full attention) through real vLLM engines: vLLM's
NixlConnector as the reference, then KVBridgeConnector on the same tiny model and prompts
(20, 70 and 150 tokens: longer than the window), negative control, prefill killed before
the pull (see families.FamilyScenarios)."""

from __future__ import annotations

import pytest
from families import FamilyScenarios

pytestmark = pytest.mark.timeout(1800)


class TestGemma3(FamilyScenarios):
    family = "gemma3"
