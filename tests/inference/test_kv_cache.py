import pytest
import torch

from inference.kv_cache import PagePool, page_checksums

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

