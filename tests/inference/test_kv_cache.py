import pytest
import torch

from inference.kv_cache import PagePool, dequantize_rows, page_checksums, quantize_rows

DTYPES = [torch.float32, torch.bfloat16]


def make_pool(**kw):
    args = dict(num_pages=4, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    args.update(kw)
    return PagePool(**args)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_page_is_one_contiguous_block_across_layers_k_and_v(dtype):
    pool = make_pool(dtype=dtype)
    assert pool.data.shape == (5, 3, 2, 4, 2, 8)  # 4 pages + the null page
    assert pool.data[2].is_contiguous()
    size = 4 if dtype == torch.float32 else 2  # a bf16 pool holds a token in half the bytes
    assert pool.bytes_per_page == 3 * 2 * 4 * 2 * 8 * size == PagePool.page_bytes(4, 3, 2, 8, dtype)
    assert pool.capacity_tokens == 16


@pytest.mark.parametrize("dtype", DTYPES)
def test_scrub_zeroes_exactly_the_given_pages(dtype):
    pool = make_pool(dtype=dtype)
    pool.data.fill_(7.0)
    pool.scrub([1, 3])
    assert pool.data[1].abs().sum() == 0 and pool.data[3].abs().sum() == 0
    assert bool((pool.data[0] == 7).all()) and bool((pool.data[2] == 7).all())
    assert pool.data[1].view(torch.uint8).count_nonzero() == 0  # every byte, not only values that compare equal


@pytest.mark.parametrize("dtype", DTYPES)
def test_write_lands_in_the_right_page_layer_and_offset(dtype):
    pool = make_pool(dtype=dtype)
    k = torch.full((2, 2, 8), 1.0)
    v = torch.full((2, 2, 8), 2.0)
    pool.write(1, torch.tensor([3, 0]), torch.tensor([2, 1]), k, v)
    assert bool((pool.data[3, 1, 0, 2] == 1).all()) and bool((pool.data[3, 1, 1, 2] == 2).all())
    assert bool((pool.data[0, 1, 0, 1] == 1).all())
    assert pool.data.float().abs().sum() == (2 * 2 * 8) * 3


def test_a_bf16_pool_rounds_what_it_is_given_to_nearest_even():
    pool = make_pool(dtype=torch.bfloat16)
    x = torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, 1 + 2 ** -9, -2.5]).repeat(4).view(1, 2, 8)  # ties, below, exact
    pool.write(0, torch.tensor([1]), torch.tensor([0]), x, -x)
    k, v = pool.data[1, 0, 0, 0], pool.data[1, 0, 1, 0]
    assert torch.equal(k, x[0].to(torch.bfloat16)) and torch.equal(v, -k)
    assert pool.data[1, 0, 0, 0, 0, :4].tolist() == [1.0, 1 + 2 ** -6, 1.0, -2.5]  # the ties went to the even neighbour


@pytest.mark.parametrize("dtype", DTYPES)
def test_export_import_round_trip_and_checksums_detect_a_flipped_bit(dtype):
    src, dst = make_pool(dtype=dtype), make_pool(dtype=dtype)
    src.data[1].normal_()
    src.data[2].normal_()
    blob = src.export_pages([2, 1])
    assert blob.dtype == dtype and blob.numel() * blob.element_size() == 2 * src.bytes_per_page
    sums = page_checksums(blob)
    dst.import_pages([0, 3], blob)
    assert torch.equal(dst.data[0], src.data[2]) and torch.equal(dst.data[3], src.data[1])
    blob.view(torch.uint8)[1, 0, 0, 0, 0, 0] ^= 1  # the lowest bit of one value of the second page
    assert page_checksums(blob)[0] == sums[0] and page_checksums(blob)[1] != sums[1]



def test_an_int8_pool_keeps_each_row_as_codes_and_its_scale_in_the_page():
    """head_dim codes then the row's fp32 scale (4 bytes): 0.53 of a bf16 pool's bytes per token at head_dim 64, and a
    page still holds everything its tokens need (scrub, export and checksums see one contiguous block)."""
    pool = make_pool(dtype=torch.int8, head_dim=64)
    assert pool.data.shape == (5, 3, 2, 4, 2, 68) and pool.data[2].is_contiguous()
    assert pool.bytes_per_page == 3 * 2 * 4 * 2 * 68 == PagePool.page_bytes(4, 3, 2, 64, torch.int8)
    assert pool.bytes_per_page / PagePool.page_bytes(4, 3, 2, 64, torch.bfloat16) == 68 / 128


def test_an_int8_pool_quantizes_each_row_by_its_largest_value_and_reads_back_within_half_a_step():
    pool = make_pool(dtype=torch.int8)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(2, 2, 8, generator=gen) * torch.tensor([1.0, 40.0]).view(1, 2, 1)  # rows of very different sizes
    v = torch.zeros(2, 2, 8)
    v[0, 1, 3] = -5.0
    pool.write(1, torch.tensor([3, 0]), torch.tensor([2, 1]), k, v)
    rows = pool.data[torch.tensor([3, 0]), 1, 0, torch.tensor([2, 1])]  # [2, 2, 12] int8
    scale = rows[..., 8:].contiguous().view(torch.float32)
    assert torch.equal(scale, k.abs().amax(-1, keepdim=True) / 127)  # each row its own scale
    assert rows[..., :8].abs().amax(-1).eq(127).all()  # the largest |value| is the full code
    back = dequantize_rows(rows)
    assert ((back - k).abs() <= scale / 2 + 1e-6).all()  # rounded to nearest: within half a step
    v_rows = pool.data[torch.tensor([3, 0]), 1, 1, torch.tensor([2, 1])]
    assert dequantize_rows(v_rows).tolist() == v.tolist()  # exact: -5 is code -127 x 5/127, zeros stay zero
    assert v_rows[1].view(torch.uint8).count_nonzero() == 0  # a row of zeros is zero bytes (its scale too)
    assert torch.equal(quantize_rows(k), rows)  # the one rule: PagePool.write is quantize_rows


def test_an_int8_pool_scrubs_exports_imports_and_checksums_its_bytes():
    src, dst = make_pool(dtype=torch.int8), make_pool(dtype=torch.int8)
    gen = torch.Generator().manual_seed(0)
    src.data[1:3] = quantize_rows(torch.randn(2, 3, 2, 4, 2, 8, generator=gen))
    blob = src.export_pages([2, 1])
    assert blob.dtype == torch.int8 and blob.numel() == 2 * src.bytes_per_page
    sums = page_checksums(blob)
    dst.import_pages([0, 3], blob)
    assert torch.equal(dst.data[0], src.data[2]) and torch.equal(dst.data[3], src.data[1])
    blob[1, 0, 0, 0, 0, 8] ^= 1  # one bit of one row's scale
    assert page_checksums(blob)[0] == sums[0] and page_checksums(blob)[1] != sums[1]
    src.scrub([1])
    assert src.data[1].view(torch.uint8).count_nonzero() == 0 and src.data[2].count_nonzero() > 0
