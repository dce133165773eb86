"""Qwen3-Next (gated delta-net + full attention) through real vLLM engines: vLLM's
NixlConnector as the reference, then KVBridgeConnector on the same tiny model and prompts
(20, 70 and 150 tokens), negative control, prefill killed before the pull (see
families.FamilyScenarios)."""

from __future__ import annotations

import pytest
from families import FamilyScenarios

pytestmark = pytest.mark.timeout(1800)


class TestQwen3Next(FamilyScenarios):
    family = "qwen3next"
