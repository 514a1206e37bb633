"""The KV pool's memory on transparent huge pages (inference.hugepages): zeroed, aligned, writable, alive as long
as its tensor, and what the engine's pool really sits on where the kernel gives huge pages."""
import gc

import pytest
import torch

from inference.hugepages import HUGE, huge_share, huge_zeros, thp_mode
from inference.kv_cache import PagePool

THP = thp_mode() in ("always", "madvise")


def test_a_large_tensor_starts_on_a_2mb_boundary_zeroed_and_keeps_its_memory_after_gc():
    t = huge_zeros((3, 1 << 20), torch.float32)  # 12 MB
    assert t.shape == (3, 1 << 20) and t.dtype == torch.float32 and t.is_contiguous()
    assert int(t.abs().sum()) == 0
    if THP:
        assert t.data_ptr() % HUGE == 0
    t[2, -1] = 7.0
    view = t[2]
    del t
    gc.collect()  # the mapping lives while a view of its storage does
    view[0] = 5.0
    assert float(view.sum()) == 12.0


def test_a_small_tensor_is_plain_memory():
    t = huge_zeros((16, 16), torch.bfloat16)
    assert t.shape == (16, 16) and int(t.float().abs().sum()) == 0


@pytest.mark.skipif(not THP, reason=f"this kernel gives no transparent huge pages (THP: {thp_mode() or 'absent'})")
def test_the_engines_pool_sits_on_huge_pages():
    pool = PagePool(num_pages=512, page_size=16, num_layers=30, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16)
    assert pool.data.numel() * pool.data.element_size() > 32 * HUGE
    assert huge_share(pool.data) > 0.5, "the pool is on 4 KB pages: every scattered page read walks the TLB"
    plain = torch.zeros(pool.data.shape, dtype=pool.data.dtype)  # what it was before: malloc'd, not advised
    assert huge_share(plain) < 0.5 or thp_mode() == "always"


def test_a_pool_on_huge_pages_scrubs_exports_and_imports_its_bytes():
    pool = PagePool(num_pages=256, page_size=16, num_layers=4, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)
    pool.data[3].normal_()
    pool.data[5].normal_()
    saved = pool.export_pages([3, 5])
    pool.scrub([3])
    assert int(pool.data[3].float().abs().sum()) == 0 and int(pool.data[5].float().abs().sum()) != 0
    pool.import_pages([7, 8], saved)
    assert torch.equal(pool.data[7], saved[0]) and torch.equal(pool.data[8], saved[1])
