"""KV-cache groups: validation, defaults and the per-group compatibility refusal."""

import pytest

from kvbridge.topology import (
    CacheGroup,
    EngineSpec,
    GroupKind,
    MambaSpec,
    TopologyError,
    effective_groups,
    plan_transfer,
)

MAMBA = MambaSpec(ssm_heads=8, ssm_head_dim=4, state_size=8, n_groups=2, conv_width=4)


def spec(engine_id="p", groups=(), **kw):
    return EngineSpec(engine_id, 1, 4, 16, 4, 16, groups=groups, **kw)


def test_group_validation():
    assert CacheGroup("sliding", (0, 2), 16, 64).kind is GroupKind.SLIDING
    with pytest.raises(TopologyError, match="sliding_window"):
        CacheGroup(GroupKind.SLIDING, (0,), 16)
    with pytest.raises(TopologyError, match="only SLIDING"):
        CacheGroup(GroupKind.FULL, (0,), 16, 32)
    with pytest.raises(TopologyError, match="kind must be one of"):
        CacheGroup("local", (0,), 16)
    with pytest.raises(TopologyError, match="twice"):
        CacheGroup(GroupKind.FULL, (1, 1), 16)
    with pytest.raises(TopologyError, match="non-empty"):
        CacheGroup(GroupKind.FULL, (), 16)
    with pytest.raises(TopologyError, match="layer 1 is in groups 0 and 1"):
        spec(groups=(CacheGroup("full", (0, 1), 16), CacheGroup("sliding", (1, 2), 16, 8)))
    with pytest.raises(TopologyError, match="no Mamba spec"):
        spec(groups=(CacheGroup("full", (0,), 16), CacheGroup("mamba", (1,), 16)))


def test_default_group_is_full_of_every_layer():
    (g,) = effective_groups((), 3, 16)
    assert g.kind is GroupKind.FULL and g.layers == (0, 1, 2)
    # an explicit FULL group of every layer pairs with an engine that declares none
    plan_transfer(spec("p"), spec("d", groups=(CacheGroup("full", (0, 1, 2, 3), 16),)))


@pytest.mark.parametrize("other, field", [
    ((CacheGroup("full", (1, 3), 16),), "group count differs"),
    ((CacheGroup("full", (1, 3), 16), CacheGroup("full", (0, 2), 16)), "group 1 differs in kind"),
    ((CacheGroup("full", (1, 2), 16), CacheGroup("sliding", (0, 3), 16, 64)), "group 0 differs in layers"),
    ((CacheGroup("full", (1, 3), 16), CacheGroup("sliding", (0, 2), 16, 32)),
     r"group 1 differs in sliding_window \(64 vs 32\)"),
])
def test_mismatched_groups_are_refused_naming_group_and_field(other, field):
    mine = (CacheGroup("full", (1, 3), 16), CacheGroup("sliding", (0, 2), 16, 64))
    with pytest.raises(TopologyError, match=field):
        plan_transfer(spec("p", other), spec("d", mine))
    # the same groups plan
    plan_transfer(spec("p", mine), spec("d", mine))


def test_mamba_groups_on_a_hybrid():
    groups = (CacheGroup("full", (0, 2, 4, 6), 16), CacheGroup("mamba", (1, 3, 5, 7), 16))
    s = EngineSpec("p", 2, 4, 16, 4, 16, layout="blocks-first", mamba=MAMBA, groups=groups)
    assert s.groups == groups
