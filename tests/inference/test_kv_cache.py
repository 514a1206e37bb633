import torch

from inference.kv_cache import PagePool, page_checksums


def make_pool(**kw):
    args = dict(num_pages=4, page_size=4, num_layers=3, num_kv_heads=2, head_dim=8)
    args.update(kw)
    return PagePool(**args)


def test_a_page_is_one_contiguous_block_across_layers_k_and_v():
    pool = make_pool()
    assert pool.data.shape == (5, 3, 2, 4, 2, 8)  # 4 pages + the null page
    assert pool.data[2].is_contiguous()
    assert pool.bytes_per_page == 3 * 2 * 4 * 2 * 8 * 4
    assert pool.capacity_tokens == 16


def test_scrub_zeroes_exactly_the_given_pages():
    pool = make_pool()
    pool.data.fill_(7.0)
    pool.scrub([1, 3])
    assert pool.data[1].abs().sum() == 0 and pool.data[3].abs().sum() == 0
    assert bool((pool.data[0] == 7).all()) and bool((pool.data[2] == 7).all())


def test_write_lands_in_the_right_page_layer_and_offset():
    pool = make_pool()
    k = torch.full((2, 2, 8), 1.0)
    v = torch.full((2, 2, 8), 2.0)
    pool.write(1, torch.tensor([3, 0]), torch.tensor([2, 1]), k, v)
    assert bool((pool.data[3, 1, 0, 2] == 1).all()) and bool((pool.data[3, 1, 1, 2] == 2).all())
    assert bool((pool.data[0, 1, 0, 1] == 1).all())
    assert pool.data.abs().sum() == (2 * 2 * 8) * 3


def test_export_import_round_trip_and_checksums_detect_a_flipped_value():
    src, dst = make_pool(), make_pool()
    src.data[1].normal_()
    src.data[2].normal_()
    blob = src.export_pages([2, 1])
    sums = page_checksums(blob)
    dst.import_pages([0, 3], blob)
    assert torch.equal(dst.data[0], src.data[2]) and torch.equal(dst.data[3], src.data[1])
    blob[1, 0, 0, 0, 0, 0] += 1
    assert page_checksums(blob)[0] == sums[0] and page_checksums(blob)[1] != sums[1]
