"""Findings about kvbridge.topology made while proving descriptor geometry.

These fail until topology is fixed; they are reported to the lead, not worked around.
"""

from kvbridge.topology import EngineSpec, Layout, element_layout


def test_cross_layer_kv_first_region_block_bytes_covers_all_elements():
    # element_layout(cross_layer, kv-first): per-layer slot is K *and* V, but
    # region_block_bytes is computed from the K-only region size.
    s = EngineSpec(engine_id="x", tp_size=1, num_kv_heads=2, head_dim=4, num_layers=3,
                   block_size=4, layout=Layout.KV_FIRST, cross_layer=True)
    lay = element_layout(s)
    assert lay.element_offsets[-1] + lay.element_bytes <= lay.region_block_bytes
