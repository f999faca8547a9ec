"""DeepSeek-V3 671B: the paper's parameter counts (arXiv 2412.19437, section 1 and table 1)."""

import mff


def test_v3_671b_counts():
    counts = mff.build("deepseek3", size="v3-671b").param_counts()
    assert abs(counts["total_no_mtp"] / 671e9 - 1) < 0.01
    assert abs(counts["activated_no_mtp"] / 37e9 - 1) < 0.02
    assert counts["total"] > counts["total_no_mtp"]  # MTP adds a layer


def test_skeleton_is_meta_and_buffer_free():
    m = mff.build("deepseek3", size="v3-671b")
    assert all(p.is_meta for p in m.skeleton.parameters())
    assert not list(m.skeleton.buffers())
