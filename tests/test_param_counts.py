"""Parameter counts of the named sizes against the published ones (DeepSeek-V3: arXiv 2412.19437, section 1 and table 1)."""

import pytest

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


# Published totals (model cards / release notes), within 1.5%: the named sizes use the real dimensions.
PUBLISHED = [
    ("qwen3", "0.6b", 0.6e9), ("qwen3", "8b", 8.2e9), ("qwen3", "32b", 32.8e9),
    ("qwen3_moe", "30b-a3b", 30.5e9), ("qwen3_moe", "235b-a22b", 235e9),
    ("glm4", "9b-0414", 9.4e9), ("glm4", "32b-0414", 32.6e9),
    ("glm4_moe", "glm-4.5-air", 106e9),
    ("llama", "smollm2-135m", 134.5e6), ("llama", "llama2-7b", 6.74e9), ("llama", "llama3.1-8b", 8.03e9),
]



@pytest.mark.parametrize("family,size,total", PUBLISHED)
def test_published_sizes(family, size, total):
    m = mff.build(family, size=size)
    assert all(p.is_meta for p in m.skeleton.parameters())
    assert abs(m.param_counts()["total"] / total - 1) < 0.015


def test_moe_activated_counts():
    assert abs(mff.build("qwen3_moe", size="30b-a3b").param_counts()["activated"] / 3.0e9 - 1) < 0.1  # "A3B"
    assert abs(mff.build("qwen3_moe", size="235b-a22b").param_counts()["activated"] / 22e9 - 1) < 0.05  # "A22B"
    assert abs(mff.build("glm4_moe", size="glm-4.5").param_counts()["activated"] / 32e9 - 1) < 0.05  # 32B active
