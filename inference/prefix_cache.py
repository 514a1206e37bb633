"""The prefix cache of one engine: the hash-chain index (chain over (salt, each full page's tokens) -> cached
page), its LRU order and its query/hit counts. Pages, scopes and readers live in the ledger and the block
manager's mirror; this module only decides which pages to keep, to reuse and to evict.
"""
import hashlib
from array import array
from collections import Counter, OrderedDict
from dataclasses import dataclass

from inference.allocator import cache_entry
from inference.block_manager import BlockManager
from inference.sequence import Sequence


@dataclass(frozen=True)
class CachedPage:
    page: int
    epoch: int
    salt: str
    key: bytes  # its chain hash


def chain_keys(salt: str, tokens: list[int], page_size: int, num_pages: int) -> list[bytes]:
    """key[i] = H(key[i-1] || tokens of page i), key[-1] = H(salt): equal only for the same scope and the
    same tokens in every page up to i."""
    keys, h = [], hashlib.sha256(b"kvserve-prefix\0" + salt.encode()).digest()
    for i in range(num_pages):
        h = hashlib.sha256(h + array("q", tokens[i * page_size:(i + 1) * page_size]).tobytes()).digest()
        keys.append(h)
    return keys


class PrefixCache:
    def __init__(self, block_manager: BlockManager):
        self.bm = block_manager
        self.page_size = block_manager.page_size
        block_manager.prefix_cache = self
        self.index: dict[bytes, CachedPage] = {}
        self.lru: OrderedDict[int, CachedPage] = OrderedDict()  # cached pages, least recently used first
        self.queries: Counter[str] = Counter()  # by salt: admissions that looked the prompt up
        self.hits: Counter[str] = Counter()  # by salt: admissions that reused at least one page
        self.hit_tokens: Counter[str] = Counter()

    def __len__(self) -> int:
        return len(self.lru)

    def match(self, seq: Sequence) -> list[CachedPage]:
        """The longest cached prefix of seq's prompt, in full pages; at least one prompt token is left to
        compute (its logits give the first output token)."""
        most = (seq.num_prompt_tokens - 1) // self.page_size
        found = []
        for key in chain_keys(seq.salt, seq.prompt_ids, self.page_size, most):
            hit = self.index.get(key)
            if hit is None:
                break
            found.append(hit)
        return found

    def admit(self, seq: Sequence, pages_short, keep_free: int = 0) -> bool:
        """Gives a waiting sequence its pages: the cached prefix of its scope (read, shared), then
        `pages_short(seq)` of its own, leaving `keep_free` free. False when they do not fit now (nothing is
        held then)."""
        hits = self.match(seq) if seq.salt else []
        if seq.salt:
            self.queries[seq.salt] += 1
        if hits and not self.bm.share(seq, [h.page for h in hits], [h.epoch for h in hits]):
            hits = []
        for h in reversed(hits):  # in use: the last to be evicted, the chain's tail before its head
            self.lru.move_to_end(h.page)
        if not self.bm.allocate(seq, pages_short(seq), keep_free):
            self.bm.unshare(seq)
            return False
        seq.num_cached = seq.cached_tokens = len(hits) * self.page_size
        if hits:
            self.hits[seq.salt] += 1
            self.hit_tokens[seq.salt] += seq.cached_tokens
        return True

    def keep(self, seq: Sequence) -> None:
        """A finished prompt's own full pages whose prefix is not cached yet join the cache."""
        n_full = seq.num_prompt_tokens // self.page_size
        keys = chain_keys(seq.salt, seq.prompt_ids, self.page_size, n_full)
        indices = [i for i in range(seq.num_shared, n_full) if keys[i] not in self.index]
        if not indices:
            return
        if self.bm.cache_pages(seq, indices) is None:
            return  # the ledger did not take them: freed with the sequence's other pages
        for i in reversed(indices):  # a chain's tail is evicted before its head (a head alone still hits)
            c = CachedPage(seq.block_table[i], seq.page_epochs[i], seq.salt, keys[i])
            self.index[c.key] = c
            self.lru[c.page] = c

    def evict(self, num_pages: int) -> int:
        """Evicts least-recently-used cached pages nobody reads, until `num_pages` are free (or none is left
        to evict); returns how many it evicted."""
        free = self.bm.num_free()
        if free is None:  # the ledger is unreachable: no shortage is known
            return 0
        short = num_pages - free
        chosen = []
        for page, c in self.lru.items():
            if len(chosen) >= short:
                break
            if not self.bm.readers[page]:
                chosen.append(c)
        by_salt: dict[str, list[CachedPage]] = {}
        for c in chosen:
            by_salt.setdefault(c.salt, []).append(c)
        for salt, group in by_salt.items():
            self.bm.evict_pages(salt, [c.page for c in group], [c.epoch for c in group])
            self._drop(group)
        return len(chosen)

    def forget(self, pages) -> None:
        """Pages the ledger took back (reaped) or a reset wiped: no longer in the index."""
        self._drop([self.lru[p] for p in pages if p in self.lru])

    def clear(self) -> None:
        self.index.clear()
        self.lru.clear()

    def entry_pages(self, entry: str) -> list[CachedPage]:
        """The indexed pages of cache entry `entry` (the owner of one scope's cached pages)."""
        return [c for c in self.lru.values() if cache_entry(c.salt) == entry]

    def pages_by_salt(self) -> Counter[str]:
        return Counter(c.salt for c in self.lru.values())

    def _drop(self, group: list[CachedPage]) -> None:
        for c in group:
            self.lru.pop(c.page, None)
            if self.index.get(c.key) == c:
                del self.index[c.key]
