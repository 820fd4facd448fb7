"""KV tensor geometry: where the block dimension is and how many kernel blocks make a block.

Byte-exact copies in each layout are checked through the copier (``test_copy.py``,
``test_copy_layouts.py``).
"""

from __future__ import annotations

import pytest

from tokencake.serving.vllm._kv_layout import GeometryError, block_geometry, find_block_dim


def test_find_block_dim() -> None:
    assert find_block_dim((40, 3, 128, 128), 40) == 0
    assert find_block_dim((2, 40, 16, 8, 64), 40) == 1
    with pytest.raises(ValueError, match="no dimension"):
        find_block_dim((2, 16), 40)


def test_block_geometry_finds_blocks_and_kernel_blocks() -> None:
    assert block_geometry((40, 3, 128, 128), 40) == (0, 1)
    assert block_geometry((2, 40, 16, 8, 64), 40) == (1, 1)  # K/V-first
    assert block_geometry((160, 3, 32, 128), 40) == (0, 4)  # 4 kernel blocks per scheduler block
    # dim 0 wins over a later dim that happens to equal num_blocks
    assert block_geometry((80, 40, 16, 8), 40) == (0, 2)
    with pytest.raises(GeometryError, match="no dimension"):
        block_geometry((30, 3, 16, 8), 40)
    with pytest.raises(GeometryError):
        block_geometry((40, 3), 0)
