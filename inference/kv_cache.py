"""The KV page pool: one preallocated, pre-faulted tensor (on huge pages where Linux gives them: inference.hugepages)
in which a page is contiguous across layers, K and V, so that scrubbing a page is one indexed fill. Its dtype is the
model's, bf16 under a reduced precision, or int8 when asked for (inference.precision.kv_dtype_for): export, import,
checksums and scrub work on its bytes.

Layout: data[page, layer, k_or_v, offset, kv_head, row]. A row is head_dim values; in an int8 pool head_dim codes
and then their fp32 scale in 4 bytes (value = code x scale, scale = max |x| / 127 of the row: quantize_rows), so
a page still holds everything its tokens need and all-zero bytes are still zeros. Row `num_pages` is the null page:
never allocated, always zero, used to pad block tables.
"""
import hashlib

import torch

from inference.arith import cdiv  # noqa: F401  (re-exported: the pool's users size pages with it)
from inference.hugepages import huge_zeros


class PagePool:
    def __init__(self, num_pages: int, page_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype=torch.float32, device="cpu"):
        if num_pages <= 0 or page_size <= 0:
            raise ValueError("num_pages and page_size must be positive")
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.null_page = num_pages
        shape = (num_pages + 1, num_layers, 2, page_size, num_kv_heads, row_width(head_dim, dtype))
        # on the CPU in 2 MB pages where the kernel gives them (inference.hugepages: a step reads pages scattered
        # over all of it)
        self.data = huge_zeros(shape, dtype) if torch.device(device).type == "cpu" else \
            torch.empty(shape, dtype=dtype, device=device)
        self.data.fill_(0)  # touch every page now: first-touch faults would otherwise land on the hot path
        self.num_scrubbed = 0  # pages zeroed since start (a metric: kvserve_scrubbed_pages_total)

    @staticmethod
    def page_bytes(page_size, num_layers, num_kv_heads, head_dim, dtype) -> int:
        return page_size * num_layers * 2 * num_kv_heads * row_width(head_dim, dtype) * \
            torch.empty((), dtype=dtype).element_size()

    @property
    def capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def bytes_per_page(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """This step's K and V rows into their slots (rounded to nearest even into a bf16 pool, quantized per row into
        an int8 pool)."""
        self.data[pages, layer, 0, offsets] = pool_rows(k, self.data.dtype)
        self.data[pages, layer, 1, offsets] = pool_rows(v, self.data.dtype)

    def scrub(self, pages) -> None:
        if len(pages):
            idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.data.device)
            self.data.index_fill_(0, idx, 0)
            self.num_scrubbed += len(idx)

    def export_pages(self, pages) -> torch.Tensor:
        """A copy of whole pages, [n, layers, 2, page_size, kv_heads, row] (row: head_dim, + 4 in an int8 pool)."""
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.data.device)
        return self.data.index_select(0, idx).cpu()

    def import_pages(self, pages, blob: torch.Tensor) -> None:
        idx = torch.as_tensor(list(pages), dtype=torch.long, device=self.data.device)
        if blob.shape[1:] != self.data.shape[1:] or blob.shape[0] != len(idx):
            raise ValueError(f"page blob shape {tuple(blob.shape)} does not fit pool pages {tuple(self.data.shape[1:])}")
        self.data.index_copy_(0, idx, blob.to(device=self.data.device, dtype=self.data.dtype))


def page_checksums(blob: torch.Tensor) -> list[str]:
    """sha256 per page of an exported page blob (first 16 hex digits)."""
    raw = blob.contiguous().view(torch.uint8).reshape(blob.shape[0], -1).numpy()
    return [hashlib.sha256(row.tobytes()).hexdigest()[:16] for row in raw]


SCALE_BYTES = 4  # an int8 row's fp32 scale, after its codes


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements in a pool row: head_dim, and an int8 row's scale bytes."""
    return head_dim + (SCALE_BYTES if dtype == torch.int8 else 0)


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """fp32 rows [..., head_dim] -> int8 rows [..., head_dim + 4]: codes round(x / scale) (nearest even) with
    scale = max |x| / 127 (fp32), then the scale's bytes; a row of zeros is all zero bytes, a row with a NaN codes 0
    and a NaN scale (it reads back as NaN, as an fp32 pool's would). The native rope_store
    (inference/native/fused.cpp) writes the same bytes."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    codes = torch.where(scale > 0, torch.round(x / torch.where(scale > 0, scale, 1)), 0).clamp(-127, 127)
    return torch.cat([codes.to(torch.int8), scale.contiguous().view(torch.int8)], -1)


def dequantize_rows(rows: torch.Tensor) -> torch.Tensor:
    """int8 rows [..., head_dim + 4] -> fp32 values [..., head_dim]: code x scale, as the native kernel reads them."""
    d = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., d:].contiguous().view(torch.float32)
    return rows[..., :d].float() * scale


def pool_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """K or V rows as a pool of `dtype` keeps them: cast, or quantized per row into an int8 pool."""
    return quantize_rows(x) if dtype == torch.int8 else x.to(dtype)
