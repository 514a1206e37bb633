"""The ledger's Redis key names: the one module that builds them (`{prefix}:pools`, `{prefix}:pool:{id}:{part}`),
and the order in which every script gets a pool's keys."""

# Every script gets the pool's fixed keys as KEYS in this order, and ARGV[1..2] = owner-key prefix, pool id.
_KEY_PARTS = ("meta", "free", "page_owner", "page_epoch", "owners", "leases", "dirty", "epoch", "scrubbing")
# Shared (prefix-cache) pages, after the pool's fixed keys: scope (page -> salt of each cached page),
# reader_scope (reader -> the salt it reads under), and two key prefixes: readers:<page>, reads:<owner>.
_SHARED_PARTS = ("scope", "reader_scope", "readers:", "reads:")
# Then last_grant: the token and reply of the pool's latest grant, so that a grant repeated after its reply was
# lost answers that grant instead of granting again.
_GRANT_PART = "last_grant"


def ledger_key(prefix: str, pool_id: str | None = None, part: str = "") -> str:
    """The one place key names are built: `{prefix}:pools`, or `{prefix}:pool:{pool_id}:{part}`."""
    if pool_id is None:
        return f"{prefix}:pools"
    return f"{prefix}:pool:{pool_id}:{part}"


def owner_prefix(prefix: str, pool_id: str) -> str:
    """What an owner's name follows in the key of the set of pages it holds (ARGV[1] of every script)."""
    return ledger_key(prefix, pool_id, "owner:")


def pool_keys(prefix: str, pool_id: str) -> list[str]:
    """A pool's KEYS for its scripts, in the order scripts.PREAMBLE unpacks them."""
    return ([ledger_key(prefix, pool_id, part) for part in _KEY_PARTS] + [ledger_key(prefix)]
            + [ledger_key(prefix, pool_id, part) for part in _SHARED_PARTS] + [ledger_key(prefix, pool_id, _GRANT_PART)])


def text(value) -> str:
    """A name or value read back from these keys as str, whether or not the client decodes responses."""
    return value.decode() if isinstance(value, bytes) else value
