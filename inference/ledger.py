"""The page ledger in Redis: which owner holds which page of a pool, under which epoch, until when.

This is the only module that reads or writes the ledger's keys; every mutation is one Lua script.
A pool belongs to one worker process (its id is the worker's id): only that process grants its pages,
renews and reaps its leases and scrubs its dirty pages; anyone else may read it, or delete the pool of
a worker that is gone (`unregister`), never mark its pages clean. Epochs are fencing tokens: a pool
re-registered after its records were lost starts a new generation whose epochs are above every epoch
its worker has seen (`reset`), and a client refuses a pool whose counter is behind what it saw.
A script runs again after a dropped connection only where REPEAT says a repeat is harmless (inference.retry).
"""
import logging
import time
import uuid
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Sequence

import redis
from redis.exceptions import ResponseError

from inference.allocator import CACHE_ENTRY_PREFIX, Grant, IntegrityError, LedgerError, NotHolding, PoolLost, cache_entry
from inference.retry import repeat

log = logging.getLogger(__name__)

ROLES = ("prefill", "decode", "sandbox")
# Every script gets the pool's fixed keys as KEYS in this order, and ARGV[1..2] = owner-key prefix, pool id.
_KEY_PARTS = ("meta", "free", "page_owner", "page_epoch", "owners", "leases", "dirty", "epoch", "scrubbing")
GENERATION_SPAN = 2**32  # epochs of generation g lie in (g * span, (g + 1) * span]
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


@dataclass(frozen=True)
class ReclaimEvent:
    """An owner whose lease ran out: its pages went to the dirty set and wait to be scrubbed."""

    pool_id: str
    owner: str
    pages: tuple[int, ...]
    epochs: tuple[int, ...]
    expired_at_ms: int


@dataclass(frozen=True)
class Beat:
    """One heartbeat of the pool's worker: the owners it renews that hold no lease (taken back), and the
    other owners whose leases expired and were reaped into the dirty set."""

    missing: tuple[str, ...]
    reclaimed: tuple[ReclaimEvent, ...]


_PREAMBLE = """
local meta, free, page_owner, page_epoch, owners, leases, dirty, epoch, scrubbing, pools = unpack(KEYS)
local owner_prefix, pool = ARGV[1], ARGV[2]
local scope, reader_scope, readers_prefix, reads_prefix = KEYS[11], KEYS[12], KEYS[13], KEYS[14]
local last_grant = KEYS[15]
local function fail(kind, msg) return redis.error_reply(kind .. ' pool ' .. pool .. ': ' .. msg) end
local function unregistered()
  return fail('UNREGISTERED', 'not registered; its worker registers it at start (was Redis restarted '
    .. 'without persistence, failed over, or flushed?)')
end
local function int(x) return string.format('%d', x) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function by_number(a, b) return tonumber(a) < tonumber(b) end
-- {readers of every page in scope: {page, {readers}}, ...}, {reads of each of `names`}
local function shared_sets(names)
  local by_page, by_owner = {}, {}
  for _, p in ipairs(redis.call('HKEYS', scope)) do
    by_page[#by_page + 1] = {p, redis.call('SMEMBERS', readers_prefix .. p)}
  end
  for i, o in ipairs(names) do by_owner[i] = redis.call('SMEMBERS', reads_prefix .. o) end
  return {by_page, by_owner}
end
-- a client that has seen epoch `floor` refuses a counter behind it: epochs would repeat
local function behind(floor)
  local counter = tonumber(redis.call('GET', epoch) or '0')
  if counter < floor then
    return fail('UNREGISTERED', 'epoch counter ' .. int(counter) .. ' is behind epoch ' .. int(floor)
      .. ' its worker was granted (Redis lost writes: failover or restore)')
  end
end
local function registered() return redis.call('EXISTS', meta) == 1 end
-- every owner any record names, so a reset or an audit misses none
local function all_owners()
  local seen, out = {}, {}
  local function add(list)
    for _, o in ipairs(list) do
      if not seen[o] then seen[o] = true; out[#out + 1] = o end
    end
  end
  add(redis.call('SMEMBERS', owners))
  add(redis.call('HVALS', page_owner))
  add(redis.call('ZRANGE', leases, 0, -1))
  add(redis.call('HKEYS', reader_scope))
  return out
end
local function wipe()
  for _, o in ipairs(all_owners()) do redis.call('DEL', owner_prefix .. o, reads_prefix .. o) end
  for _, p in ipairs(redis.call('HKEYS', scope)) do redis.call('DEL', readers_prefix .. p) end
  redis.call('DEL', meta, free, page_owner, page_epoch, owners, leases, dirty, scrubbing, scope, reader_scope,
             last_grant)
end
-- ---- shared pages ----
-- ends every read of `owner` (its pages in reads:<owner>)
local function drop_reads(owner)
  local rkey = reads_prefix .. owner
  for _, page in ipairs(redis.call('SMEMBERS', rkey)) do redis.call('SREM', readers_prefix .. page, owner) end
  redis.call('DEL', rkey)
  redis.call('HDEL', reader_scope, owner)
end
-- a cached page leaves the cache: its scope and its readers' records go (the readers fail in their engine)
local function uncache(page)
  for _, r in ipairs(redis.call('SMEMBERS', readers_prefix .. page)) do
    redis.call('SREM', reads_prefix .. r, page)
    if redis.call('SCARD', reads_prefix .. r) == 0 then redis.call('HDEL', reader_scope, r) end
  end
  redis.call('DEL', readers_prefix .. page)
  redis.call('HDEL', scope, page)
end
-- an owner holding neither pages nor reads leaves the owner index and its lease goes
local function settle(owner)
  if redis.call('SCARD', owner_prefix .. owner) == 0 and redis.call('SCARD', reads_prefix .. owner) == 0 then
    redis.call('SREM', owners, owner)
    redis.call('ZREM', leases, owner)
    return true
  end
  return false
end
local function state_of(page)
  local holder = redis.call('HGET', page_owner, page)
  if holder then
    return 'it is held by ' .. holder .. ' at epoch ' .. (redis.call('HGET', page_epoch, page) or '?')
  end
  if redis.call('SISMEMBER', dirty, page) == 1 then
    local by = redis.call('HGET', scrubbing, page)
    return 'it is dirty, waiting to be scrubbed' .. (by and (' by ' .. by) or '')
  end
  if redis.call('LPOS', free, page) then return 'it is free' end
  return 'it is not a page of this pool (0..' .. (redis.call('HGET', meta, 'num_pages') - 1) .. ')'
end
-- The error for the first of the k pages ARGV[base+1..] at epochs ARGV[base+k+1..] that `owner` does not
-- hold at that epoch, lists twice, or that is cached; nil when it holds them all (`verb`: free, cache).
local function refuse_unheld(owner, k, base, verb, cached_msg)
  local seen = {}
  for i = 1, k do
    local page, e = ARGV[base + i], ARGV[base + k + i]
    if seen[page] then return fail('LEDGER', 'page ' .. page .. ' is listed twice; ' .. verb .. ' each page once') end
    seen[page] = true
    if redis.call('HGET', page_owner, page) ~= owner or redis.call('HGET', page_epoch, page) ~= e then
      return fail('LEDGER', owner .. ' cannot ' .. verb .. ' page ' .. page .. ' at epoch ' .. e .. ': ' .. state_of(page))
    end
    if redis.call('HEXISTS', scope, page) == 1 then
      return fail('LEDGER', owner .. ' cannot ' .. verb .. ' page ' .. page .. ': ' .. cached_msg)
    end
  end
  return nil
end

local function misfiled(owner, page)
  return fail('INTEGRITY', owner .. ' lists page ' .. page .. ' but ' .. state_of(page)
    .. '; run check_integrity')
end
-- pushes the leases of the owners ARGV[first..] to `expiry`; returns the owners that hold none
local function renew(expiry, first)
  local missing = {}
  for i = first, #ARGV do
    if redis.call('ZSCORE', leases, ARGV[i]) then
      redis.call('ZADD', leases, expiry, ARGV[i])
    else
      missing[#missing + 1] = ARGV[i]
    end
  end
  return missing
end
-- moves the pages of every owner whose lease expired before `now` to the dirty set; all or nothing
local function reap(now)
  local expired = redis.call('ZRANGEBYSCORE', leases, '-inf', int(now), 'WITHSCORES')
  local events, doomed = {}, {}
  for i = 1, #expired, 2 do
    local owner = expired[i]
    local pages = redis.call('SMEMBERS', owner_prefix .. owner)
    table.sort(pages, by_number)
    local flat = {}
    for _, page in ipairs(pages) do
      local e = redis.call('HGET', page_epoch, page)
      if redis.call('HGET', page_owner, page) ~= owner or not e then
        return nil, misfiled(owner, page)
      end
      flat[#flat + 1] = tonumber(page)
      flat[#flat + 1] = tonumber(e)
    end
    events[#events + 1] = {owner, tonumber(expired[i + 1]), flat}
    doomed[#doomed + 1] = pages
  end
  for i, ev in ipairs(events) do
    local owner = ev[1]
    for _, page in ipairs(doomed[i]) do
      redis.call('HDEL', page_owner, page)
      redis.call('HDEL', page_epoch, page)
      redis.call('SADD', dirty, page)
      uncache(page)
    end
    drop_reads(owner)
    redis.call('DEL', owner_prefix .. owner)
    redis.call('SREM', owners, owner)
    redis.call('ZREM', leases, owner)
  end
  return events
end
"""

_SCRIPTS = {
    # ARGV: role, num_pages, page_size, generation, min_epoch. The epoch counter survives and never
    # goes below min_epoch: fencing tokens never repeat, even when the counter itself was lost.
    "register": """
local num_pages, min_epoch = tonumber(ARGV[4]), tonumber(ARGV[7])
wipe()
redis.call('HSET', meta, 'role', ARGV[3], 'num_pages', int(num_pages), 'page_size', ARGV[5],
           'generation', ARGV[6], 'created', int(now_ms()))
if tonumber(redis.call('GET', epoch) or '0') < min_epoch then redis.call('SET', epoch, int(min_epoch)) end
local batch = {}
for page = 0, num_pages - 1 do
  batch[#batch + 1] = int(page)
  if #batch == 1000 or page == num_pages - 1 then
    redis.call('RPUSH', free, unpack(batch))
    batch = {}
  end
end
redis.call('SADD', pools, pool)
return num_pages
""",
    "unregister": """
wipe()
redis.call('DEL', epoch)
redis.call('SREM', pools, pool)
return 1
""",
    # ARGV: ttl_ms, must_hold, floor, keep_free, k, k owners, k counts, token. All or nothing: {page, epoch, ...}
    # for the owners in the order given, nil when fewer than (their total + keep_free) pages are free, or
    # {'missing', owners...} when must_hold and those owners hold nothing (granting nothing).
    # One script for a single grant and for a step's growth of many sequences (one round trip). A grant that
    # granted pages records its token and reply in last_grant; the same token again answers that reply.
    "grant": """
local ttl_ms, must_hold, keep_free, k = tonumber(ARGV[3]), ARGV[4], tonumber(ARGV[6]), tonumber(ARGV[7])
if not registered() then return unregistered() end
local token = ARGV[8 + 2 * k]
if redis.call('HGET', last_grant, 'token') == token then return cjson.decode(redis.call('HGET', last_grant, 'reply')) end
local stale = behind(tonumber(ARGV[5]))
if stale then return stale end
local total, missing = 0, {'missing'}
for i = 1, k do
  local owner = ARGV[7 + i]
  if must_hold == '1' and redis.call('SCARD', owner_prefix .. owner) == 0 then missing[#missing + 1] = owner end
  total = total + tonumber(ARGV[7 + k + i])
end
if #missing > 1 then return missing end
if redis.call('LLEN', free) < total + keep_free then return false end
if total == 0 then return {} end
local pages = redis.call('LPOP', free, total)
local first = redis.call('INCRBY', epoch, total) - total
local expiry = int(now_ms() + ttl_ms)
local out, j = {}, 0
for i = 1, k do
  local owner, n = ARGV[7 + i], tonumber(ARGV[7 + k + i])
  local okey = owner_prefix .. owner
  for _ = 1, n do
    j = j + 1
    local page = pages[j]
    redis.call('HSET', page_owner, page, owner)
    redis.call('HSET', page_epoch, page, int(first + j))
    redis.call('SADD', okey, page)
    out[#out + 1] = tonumber(page)
    out[#out + 1] = first + j
  end
  if n > 0 then
    redis.call('SADD', owners, owner)
    redis.call('ZADD', leases, expiry, owner)
  end
end
redis.call('HSET', last_grant, 'token', token, 'reply', cjson.encode(out))
return out
""",
    # ARGV: owner, k, k pages, k epochs. All or nothing. Returns how many pages the owner still holds.
    "free": """
local owner, k = ARGV[3], tonumber(ARGV[4])
local okey = owner_prefix .. owner
if not registered() then return unregistered() end
local refused = refuse_unheld(owner, k, 4, 'free', 'it is cached; evict it instead')
if refused then return refused end
for i = 1, k do
  local page = ARGV[4 + i]
  redis.call('HDEL', page_owner, page)
  redis.call('HDEL', page_epoch, page)
  redis.call('SREM', okey, page)
  redis.call('RPUSH', free, page)
end
local left = redis.call('SCARD', okey)
settle(owner)
return left
""",
    # ARGV: owner. Returns the freed pages, sorted; they join the free list in that order.
    "release": """
local owner = ARGV[3]
local okey = owner_prefix .. owner
if not registered() then return unregistered() end
local pages = redis.call('SMEMBERS', okey)
table.sort(pages, by_number)
for _, page in ipairs(pages) do
  if redis.call('HGET', page_owner, page) ~= owner then
    return misfiled(owner, page)
  end
end
for _, page in ipairs(pages) do
  if redis.call('SCARD', readers_prefix .. page) > 0 then
    return fail('LEDGER', owner .. ' cannot release page ' .. page .. ': it is cached and has readers')
  end
end
local out = {}
for _, page in ipairs(pages) do
  redis.call('HDEL', page_owner, page)
  redis.call('HDEL', page_epoch, page)
  redis.call('HDEL', scope, page)
  redis.call('RPUSH', free, page)
  out[#out + 1] = tonumber(page)
end
drop_reads(owner)
redis.call('DEL', okey)
redis.call('SREM', owners, owner)
redis.call('ZREM', leases, owner)
return out
""",
    # ARGV: ttl_ms, owners... Renews only existing leases; returns the owners that hold none.
    "renew": """
if not registered() then return unregistered() end
return renew(int(now_ms() + tonumber(ARGV[3])), 4)
""",
    # ARGV: now_ms or '' for Redis TIME. Returns {{owner, expired_at_ms, {page, epoch, ...}}, ...}.
    "reap": """
if not registered() then return unregistered() end
local events, err = reap(tonumber(ARGV[3]) or now_ms())
return err or events
""",
    # The worker's heartbeat, atomically: renew the owners it runs, then reap every other expired owner.
    # No clock step can expire a lease its worker is renewing here. ARGV: ttl_ms, now_ms or '', floor,
    # owners... Returns {missing owners, reap events}.
    "beat": """
if not registered() then return unregistered() end
local stale = behind(tonumber(ARGV[5]))
if stale then return stale end
local now = tonumber(ARGV[4]) or now_ms()
local missing = renew(int(now + tonumber(ARGV[3])), 6)
local events, err = reap(now)
return err or {missing, events}
""",
    # ARGV: claimer. Claims every dirty page nobody has claimed; returns them sorted. Two beats never
    # hand the same dirty page to a scrubber twice.
    "claim_dirty": """
if not registered() then return unregistered() end
local out = {}
for _, page in ipairs(redis.call('SMEMBERS', dirty)) do
  if redis.call('HSETNX', scrubbing, page, ARGV[3]) == 1 then out[#out + 1] = tonumber(page) end
end
table.sort(out)
return out
""",
    # ARGV: owner, k, k pages, k epochs. 1 when the owner holds every page at its epoch under a lease.
    "holds": """
if not registered() then return unregistered() end
local owner, k = ARGV[3], tonumber(ARGV[4])
if not redis.call('ZSCORE', leases, owner) then return 0 end
for i = 1, k do
  local page = ARGV[4 + i]
  if redis.call('HGET', page_owner, page) ~= owner or redis.call('HGET', page_epoch, page) ~= ARGV[4 + k + i] then
    return 0
  end
end
return 1
""",
    # ARGV: claimer, pages... All or nothing: every page dirty and claimed by this claimer (it scrubbed
    # them); clean pages join the free list in the given order.
    "mark_clean": """
if not registered() then return unregistered() end
local claimer, seen = ARGV[3], {}
for i = 4, #ARGV do
  local page = ARGV[i]
  if seen[page] then
    return fail('LEDGER', 'page ' .. page .. ' is listed twice; mark each page clean once')
  end
  seen[page] = true
  if redis.call('SISMEMBER', dirty, page) == 0 then
    return fail('LEDGER', 'cannot mark page ' .. page .. ' clean: ' .. state_of(page)
      .. '; only pages from take_dirty() need scrubbing')
  end
  if redis.call('HGET', scrubbing, page) ~= claimer then
    return fail('LEDGER', claimer .. ' cannot mark page ' .. page .. ' clean: ' .. state_of(page)
      .. '; claim it with take_dirty() and scrub it first')
  end
end
for i = 4, #ARGV do
  redis.call('SREM', dirty, ARGV[i])
  redis.call('HDEL', scrubbing, ARGV[i])
  redis.call('RPUSH', free, ARGV[i])
end
return #ARGV - 3
""",
    "pages_of": """
local out = {}
for _, page in ipairs(redis.call('SMEMBERS', owner_prefix .. ARGV[3])) do
  out[#out + 1] = tonumber(page)
  out[#out + 1] = tonumber(redis.call('HGET', page_epoch, page)) or -1
end
return out
""",
    # One consistent read of every record; check_integrity and snapshot judge it in Python.
    "facts": """
local names = all_owners()
local sets = {}
for i, o in ipairs(names) do sets[i] = redis.call('SMEMBERS', owner_prefix .. o) end
return {
  redis.call('HGET', meta, 'num_pages'),
  redis.call('LRANGE', free, 0, -1),
  redis.call('SMEMBERS', dirty),
  redis.call('HGETALL', page_owner),
  redis.call('HGETALL', page_epoch),
  redis.call('SMEMBERS', owners),
  names,
  sets,
  redis.call('ZRANGE', leases, 0, -1, 'WITHSCORES'),
  redis.call('GET', epoch) or '0',
  redis.call('SISMEMBER', pools, pool),
  redis.call('HGETALL', scrubbing),
  redis.call('HGET', meta, 'generation') or '0',
  redis.call('HGETALL', scope),
  redis.call('HGETALL', reader_scope),
  shared_sets(names),
}
""",
}

# ---- shared pages (the prefix cache) ----------------------------------------------------------------------
# A cached page is owned by one cache entry (owner `cache~<salt>`) and carries its scope (the salt). Readers
# are requests of that scope; each read is in readers:<page> and reads:<reader>, under the reader's lease.
# A page with readers is neither evicted nor released; a reaped entry's pages go dirty like any other.
_SHARED_SCRIPTS = {
    # ARGV: owner, entry, salt, ttl_ms, k, k pages, k epochs. The owner's pages (full, written) move to the
    # cache entry `entry` of scope `salt`, keeping their epochs. All or nothing.
    "cache": """
local owner, entry, salt, ttl_ms, k = ARGV[3], ARGV[4], ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7])
if not registered() then return unregistered() end
local okey, ekey = owner_prefix .. owner, owner_prefix .. entry
for _, page in ipairs(redis.call('SMEMBERS', ekey)) do
  if redis.call('HGET', scope, page) ~= salt then
    return fail('INTEGRITY', 'cache entry ' .. entry .. ' holds page ' .. page .. ' of another scope')
  end
end
local refused = refuse_unheld(owner, k, 7, 'cache', 'it is cached already')
if refused then return refused end
for i = 1, k do
  local page = ARGV[7 + i]
  redis.call('HSET', page_owner, page, entry)
  redis.call('SREM', okey, page)
  redis.call('SADD', ekey, page)
  redis.call('HSET', scope, page, salt)
end
if k > 0 then
  redis.call('SADD', owners, entry)
  redis.call('ZADD', leases, int(now_ms() + ttl_ms), entry)
end
settle(owner)
return k
""",
    # ARGV: reader, salt, ttl_ms, k, k pages, k epochs. 1 when every page is cached at that epoch in scope `salt`
    # (the reader now reads them, under its lease); 0 when one was evicted meanwhile. Another scope's page,
    # or a reader that reads under another scope already, is refused.
    "hit": """
local reader, salt, ttl_ms, k = ARGV[3], ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
if not registered() then return unregistered() end
local has = redis.call('HGET', reader_scope, reader)
if has and has ~= salt then
  return fail('LEDGER', reader .. ' reads under another scope already; one request reads one scope')
end
for i = 1, k do
  local page, e = ARGV[6 + i], ARGV[6 + k + i]
  local s = redis.call('HGET', scope, page)
  if s and s ~= salt then
    return fail('LEDGER', reader .. ' cannot read cached page ' .. page .. ': it is outside its scope')
  end
  if not s or redis.call('HGET', page_epoch, page) ~= e then return 0 end
end
if k == 0 then return 1 end
for i = 1, k do
  local page = ARGV[6 + i]
  redis.call('SADD', readers_prefix .. page, reader)
  redis.call('SADD', reads_prefix .. reader, page)
end
redis.call('HSET', reader_scope, reader, salt)
redis.call('SADD', owners, reader)
if not redis.call('ZSCORE', leases, reader) then redis.call('ZADD', leases, int(now_ms() + ttl_ms), reader) end
return 1
""",
    # ARGV: reader. Ends its reads; returns how many pages it read.
    "unread": """
if not registered() then return unregistered() end
local reader = ARGV[3]
local n = redis.call('SCARD', reads_prefix .. reader)
drop_reads(reader)
settle(reader)
return n
""",
    # ARGV: entry, k, k pages, k epochs. Cached pages without readers leave the cache for the free list (their
    # worker scrubs them; the next grant gives a fresh epoch). All or nothing. Returns the entry's pages left.
    "evict": """
local entry, k = ARGV[3], tonumber(ARGV[4])
if not registered() then return unregistered() end
local ekey = owner_prefix .. entry
for i = 1, k do
  local page, e = ARGV[4 + i], ARGV[4 + k + i]
  if redis.call('HGET', page_owner, page) ~= entry or redis.call('HGET', page_epoch, page) ~= e
      or redis.call('HEXISTS', scope, page) == 0 then
    return fail('LEDGER', entry .. ' cannot evict page ' .. page .. ' at epoch ' .. e .. ': ' .. state_of(page))
  end
  if redis.call('SCARD', readers_prefix .. page) > 0 then
    return fail('LEDGER', entry .. ' cannot evict page ' .. page .. ': it has readers')
  end
end
for i = 1, k do
  local page = ARGV[4 + i]
  redis.call('HDEL', page_owner, page)
  redis.call('HDEL', page_epoch, page)
  redis.call('SREM', ekey, page)
  uncache(page)
  redis.call('RPUSH', free, page)
end
settle(entry)
return redis.call('SCARD', ekey)
""",
    "reads_of": """
local out = {}
for _, page in ipairs(redis.call('SMEMBERS', reads_prefix .. ARGV[3])) do out[#out + 1] = tonumber(page) end
table.sort(out)
return out
""",
}
_SCRIPTS.update(_SHARED_SCRIPTS)
# ARGV: pages... For each page {owner or false, epoch or false, scope or false, on the free list 0/1}: what a
# repeated script reads back to learn whether its first run took effect (RedisLedger._call).
_SCRIPTS["states"] = """
local out = {}
for i = 3, #ARGV do
  local page = ARGV[i]
  out[#out + 1] = {redis.call('HGET', page_owner, page), redis.call('HGET', page_epoch, page),
                   redis.call('HGET', scope, page), redis.call('LPOS', free, page) and 1 or 0}
end
return out
"""


@dataclass(frozen=True)
class Repeat:
    """Whether a script may run again after a dropped connection lost its reply (inference.retry), and why.
    `same`: a repeat leaves the records as the first run left them and answers as it did (or as the
    reason says). `refused`: a repeat of a run that took effect is refused by the script's own epoch or
    owner checks and changes nothing; the client then reads back whether the first run's effect is in
    place and answers from that, else the refusal stands. `never`: a repeat would do the work twice or
    lose what the first run's reply carried: the dropped connection fails the call, closed."""

    kind: str  # same | refused | never
    why: str


REPEAT = {
    "register": Repeat("same", "it resets the pool to the same fresh records; only its own worker grants from it, "
                               "and that worker is still waiting for this reply"),
    "unregister": Repeat("same", "deleting keys that are deleted already"),
    "grant": Repeat("same", "each call carries a fresh token, and a grant that granted pages records its token "
                            "and reply in the pool's last_grant (only the pool's worker grants, one call at a "
                            "time): the repeat answers the first run's grant instead of granting again. Without "
                            "the record a repeat would grant twice, the first grant's pages held under the owner's "
                            "lease by nobody who knows them"),
    "free": Repeat("refused", "pages the first run freed are on the free list, no longer the owner's at those "
                              "epochs: refuse_unheld refuses the repeat"),
    "release": Repeat("never", "its reply names the pages the caller must scrub; a repeat frees nothing and "
                               "answers [], so the first run's pages would go unscrubbed"),
    "renew": Repeat("same", "pushing an expiry to now + TTL again"),
    "reap": Repeat("same", "each expired owner is reaped once; a repeat reaps only owners that expired since, "
                           "so the first run's events are lost with its reply (their pages are dirty either way "
                           "and reach the scrubber through claim_dirty)"),
    "beat": Repeat("same", "renew, then reap (see both)"),
    "claim_dirty": Repeat("never", "a repeat answers only pages nobody has claimed: the first run's claims "
                                   "would be lost to their claimer and never scrubbed"),
    "holds": Repeat("same", "a read"),
    "mark_clean": Repeat("refused", "pages the first run marked clean are on the free list, no longer dirty: "
                                    "the repeat is refused"),
    "pages_of": Repeat("same", "a read"),
    "facts": Repeat("same", "a read"),
    "states": Repeat("same", "a read"),
    "cache": Repeat("refused", "pages the first run cached belong to the cache entry, no longer to the owner: "
                               "refuse_unheld refuses the repeat"),
    "hit": Repeat("same", "the reads are sets and the reader's scope a field, set again to the same values; its "
                          "lease is added only when it has none; nobody evicts a page with a reader meanwhile"),
    "unread": Repeat("same", "a repeat finds no reads and ends none (it answers 0; no caller uses the count)"),
    "evict": Repeat("refused", "pages the first run evicted are on the free list, no longer the entry's: the "
                               "repeat is refused"),
    "reads_of": Repeat("same", "a read"),
}
UNSETTLED = object()  # what a settle check answers when the first run's effect is not in place


def _str(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _ms(seconds: float) -> int:
    if seconds <= 0:
        raise ValueError(f"lease TTL must be positive seconds, got {seconds}")
    return max(1, round(seconds * 1000))


def _few(items, limit: int = 20) -> str:
    items = list(items)
    return str(items) if len(items) <= limit else f"{items[:limit]} and {len(items) - limit} more"


def _pool_keys(prefix: str, pool_id: str) -> list[str]:
    return ([ledger_key(prefix, pool_id, part) for part in _KEY_PARTS] + [ledger_key(prefix)]
            + [ledger_key(prefix, pool_id, part) for part in _SHARED_PARTS] + [ledger_key(prefix, pool_id, _GRANT_PART)])


def _check_request_owner(owner: str) -> None:
    _check_owner(owner)
    if owner.startswith(CACHE_ENTRY_PREFIX):
        raise LedgerError(f"owner {owner!r}: names starting with {CACHE_ENTRY_PREFIX!r} are cache entries")


def _run(script, keys: list[str], args: list) -> object:
    """Run a ledger script; its LEDGER/INTEGRITY error replies become LedgerError/IntegrityError."""
    try:
        return script(keys=keys, args=args)
    except ResponseError as e:
        kind, _, message = str(e).partition(" ")
        if kind == "INTEGRITY":
            raise IntegrityError(message) from None
        if kind == "LEDGER":
            raise LedgerError(message) from None
        if kind == "UNREGISTERED":
            raise PoolLost(message) from None
        raise


def _check_pool_id(pool_id: str) -> None:
    if not isinstance(pool_id, str) or not pool_id or ":" in pool_id:
        raise ValueError(f"pool_id must be a non-empty string without ':', got {pool_id!r}")


def _check_owner(owner: str) -> None:
    if not isinstance(owner, str) or not owner:
        raise LedgerError(f"owner must be a non-empty string, got {owner!r}")


@dataclass
class _Facts:
    num_pages: int | None
    free: list[int]
    dirty: set[int]
    page_owner: dict[int, str]
    page_epoch: dict[int, int]
    owner_index: set[str]
    owner_sets: dict[str, set[int]]
    leases: dict[str, int]
    epoch_counter: int
    is_listed: bool
    scrubbing: dict[int, str]
    generation: int
    scope: dict[int, str] = field(default_factory=dict)  # cached page -> salt
    reader_scope: dict[str, str] = field(default_factory=dict)
    readers: dict[int, set[str]] = field(default_factory=dict)  # cached page -> its readers
    reads: dict[str, set[int]] = field(default_factory=dict)  # owner -> pages it reads


class RedisLedger:
    """PageAllocator for one pool, kept in Redis so that every process sees the same owners.

    Needs Redis >= 6.2 (LPOP with a count) running with maxmemory-policy noeviction.
    """

    def __init__(
        self, redis_client: redis.Redis, pool_id: str, prefix: str = "kvs", lease_ttl_s: float = 30.0
    ):
        _check_pool_id(pool_id)
        _ms(lease_ttl_s)
        self.redis = redis_client
        self.pool_id = pool_id
        self.prefix = prefix
        self.lease_ttl_s = lease_ttl_s
        self._keys = _pool_keys(prefix, pool_id)
        self._lua = {name: redis_client.register_script(_PREAMBLE + body) for name, body in _SCRIPTS.items()}
        meta = {_str(k): _str(v) for k, v in redis_client.hgetall(self.key("meta")).items()}
        if not meta:
            raise LedgerError(
                f"pool {pool_id} is not registered under prefix {prefix!r}; start its worker "
                f"(it calls RedisLedger.register) or check the prefix and Redis database"
            )
        self.role = meta["role"]
        self.num_pages = int(meta["num_pages"])
        self.page_size = int(meta["page_size"])
        self.generation = int(meta.get("generation", 0))
        self.max_epoch = 0  # the highest epoch this client was granted or registered above: the fencing floor

    @classmethod
    def register(
        cls,
        redis_client: redis.Redis,
        pool_id: str,
        role: str,
        num_pages: int,
        page_size: int,
        prefix: str = "kvs",
        lease_ttl_s: float = 30.0,
        generation: int = 0,
    ) -> "RedisLedger":
        """Create the pool, or reset it (a restarted worker's tensor is fresh); epochs stay monotonic,
        and those of `generation` start above generation * GENERATION_SPAN."""
        _check_pool_id(pool_id)
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages} and {page_size}")
        script = redis_client.register_script(_PREAMBLE + _SCRIPTS["register"])
        owner_prefix = ledger_key(prefix, pool_id, "owner:")
        floor = generation * GENERATION_SPAN
        argv = [owner_prefix, pool_id, role, num_pages, page_size, generation, floor]
        repeat(lambda: _run(script, _pool_keys(prefix, pool_id), argv), f"ledger register of pool {pool_id}")
        ledger = cls(redis_client, pool_id, prefix, lease_ttl_s)
        ledger.max_epoch = floor
        return ledger

    def reset(self) -> None:
        """Register this pool again as a new generation, after its records were lost: every epoch it
        grants from now on is above every epoch this client has seen (and above any lost grant's)."""
        generation = max(self.generation + 1, self.max_epoch // GENERATION_SPAN + 1)
        again = self.register(self.redis, self.pool_id, self.role, self.num_pages, self.page_size, self.prefix,
                              self.lease_ttl_s, generation=generation)
        self.generation, self.max_epoch = again.generation, again.max_epoch

    def key(self, part: str) -> str:
        return ledger_key(self.prefix, self.pool_id, part)

    def _call(self, name: str, *args, settled=None) -> object:
        """Run script `name`; one that REPEAT allows runs again after a dropped connection (inference.retry).
        A repeat that a `refused` script refuses answers settled() instead, when that finds the first run's
        effect in place (else UNSETTLED: the refusal stands)."""
        argv = [self.key("owner:"), self.pool_id, *args]
        kind = REPEAT[name].kind
        if kind == "never":
            return _run(self._lua[name], self._keys, argv)
        runs = []

        def once():
            runs.append(name)
            try:
                return _run(self._lua[name], self._keys, argv)
            except LedgerError as exc:
                if kind != "refused" or len(runs) == 1 or type(exc) is not LedgerError:
                    raise
                answer = settled()
                if answer is UNSETTLED:
                    raise
                log.info("ledger %s on pool %s: its first run took effect (the reply was lost)", name, self.pool_id)
                return answer

        return repeat(once, f"ledger {name} on pool {self.pool_id}")

    def _states(self, pages: Sequence[int]) -> list[tuple[str | None, int | None, str | None, bool]]:
        """(owner, epoch, scope, on the free list) of each page, in one read."""
        return [(None if o is None else _str(o), None if e is None else int(e), None if s is None else _str(s),
                 bool(f)) for o, e, s, f in self._call("states", *pages)]

    def _all_free(self, pages: Sequence[int], answer) -> object:
        """answer() when every page is on the free list (what free, evict and mark_clean leave), else UNSETTLED."""
        return answer() if all(free for *_, free in self._states(pages)) else UNSETTLED

    def unregister(self) -> None:
        """Delete every key of this pool, its epoch counter included."""
        self._call("unregister")

    def num_free(self) -> int:
        return repeat(lambda: self.redis.llen(self.key("free")), f"free pages of pool {self.pool_id}")

    def allocate(self, owner: str, n: int, keep_free: int = 0) -> Grant | None:
        """Pop n pages off the head of the free list, each under a fresh epoch; None when fewer than
        n + keep_free are free."""
        grants = self._grant([(owner, n)], must_hold=False, keep_free=keep_free)
        return None if grants is None else grants[0]

    def extend(self, owner: str, n: int) -> Grant | None:
        """allocate() for an owner that already holds pages."""
        grants = self._grant([(owner, n)], must_hold=True)
        return None if grants is None else grants[0]

    def extend_many(self, requests: Sequence[tuple[str, int]]) -> list[Grant] | None:
        """extend() for several owners in one script (a step's growth): all or nothing, a Grant per owner in
        the order given, each owner's lease renewed; None when their total does not fit now; NotHolding
        (nothing granted) when some of them hold no pages."""
        return self._grant(list(requests), must_hold=True)

    def _grant(self, requests: list[tuple[str, int]], must_hold: bool, keep_free: int = 0) -> list[Grant] | None:
        owners = [owner for owner, _ in requests]
        for owner in owners:
            _check_request_owner(owner)
        if len(set(owners)) != len(owners):
            raise LedgerError(f"pool {self.pool_id}: owners listed twice in one grant: {owners}")
        for owner, n in requests:
            if n < 0:
                raise LedgerError(f"pool {self.pool_id}: cannot allocate {n} pages to {owner}; ask for 0 or more")
        if keep_free < 0:
            raise LedgerError(f"pool {self.pool_id}: cannot keep {keep_free} pages free; ask for 0 or more")
        counts = [int(n) for _, n in requests]
        flat = self._call("grant", _ms(self.lease_ttl_s), int(must_hold), self.max_epoch, int(keep_free),
                          len(owners), *owners, *counts, uuid.uuid4().hex)
        if flat is None:
            return None
        if flat and _str(flat[0]) == "missing":
            raise NotHolding(self.pool_id, [_str(o) for o in flat[1:]])
        grants, i = [], 0
        for n in counts:
            chunk = flat[2 * i: 2 * (i + n)]
            grants.append(Grant(tuple(chunk[0::2]), tuple(chunk[1::2])))
            i += n
        if flat:
            self.max_epoch = max(self.max_epoch, *flat[1::2])
        return grants

    def free(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> int | None:
        """Return pages to the tail of the free list; all or nothing, only at the epochs they were granted.
        Returns how many pages the owner still holds (None when nothing was listed)."""
        _check_owner(owner)
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: free got {len(pages)} pages but {len(epochs)} epochs")
        if not pages:
            return None
        return self._call("free", owner, len(pages), *pages, *epochs,
                          settled=lambda: self._all_free(pages, lambda: len(self.pages_of(owner))))

    def release(self, owner: str) -> list[int]:
        """Free everything the owner holds and drop its lease; returns the pages, sorted."""
        _check_owner(owner)
        return self._call("release", owner)

    def renew_leases(self, owners: Sequence[str], ttl_s: float | None = None) -> list[str]:
        """Push the owners' lease expiry to now + ttl_s; returns the owners that hold no lease (reaped)."""
        ttl_ms, owners = _ms(self.lease_ttl_s if ttl_s is None else ttl_s), list(owners)
        return [_str(o) for o in self._call("renew", ttl_ms, *owners)] if owners else []

    def reap_expired(self, now_ms: int | None = None) -> list[ReclaimEvent]:
        """Move the pages of every owner whose lease expired to the dirty set (never straight to free).
        Its worker does this in `beat`; others call it only to inject a lost lease (tests)."""
        return list(self._events(self._call("reap", "" if now_ms is None else int(now_ms))))

    def _events(self, events) -> tuple[ReclaimEvent, ...]:
        return tuple(ReclaimEvent(self.pool_id, _str(owner), tuple(flat[0::2]), tuple(flat[1::2]), expired_at_ms)
                     for owner, expired_at_ms, flat in events)

    def beat(self, owners: Sequence[str], now_ms: int | None = None) -> Beat:
        """The pool worker's heartbeat, one atomic script: renew `owners` (the requests it runs), then
        reap every other owner whose lease expired (Redis TIME, or `now_ms`). Raises PoolLost when the
        pool is gone or its epoch counter is behind what this client was granted."""
        missing, events = self._call("beat", _ms(self.lease_ttl_s), "" if now_ms is None else int(now_ms),
                                     self.max_epoch, *owners)
        return Beat(tuple(_str(o) for o in missing), self._events(events))

    def holds(self, owner: str, pages: Sequence[int], epochs: Sequence[int]) -> bool:
        """Whether `owner` holds every page at its epoch, under a lease."""
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        return bool(self._call("holds", owner, len(pages), *pages, *epochs))

    def take_dirty(self, claimer: str) -> list[int]:
        """Claims, for `claimer` to scrub, every dirty page no one has claimed; sorted. They stay dirty
        (and claimed) until `mark_clean`: a page is never handed to two scrubs."""
        return [int(p) for p in self._call("claim_dirty", claimer)]

    def mark_clean(self, pages: Sequence[int], claimer: str) -> None:
        """Scrubbed pages join the tail of the free list; each must be dirty and claimed by `claimer`
        (all or nothing)."""
        pages = [int(p) for p in pages]
        if pages:
            self._call("mark_clean", claimer, *pages, settled=lambda: self._all_free(pages, lambda: None))

    def owner_of(self, page: int) -> tuple[str, int] | None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hget(self.key("page_owner"), page).hget(self.key("page_epoch"), page)
            owner, epoch = pipe.execute()
        return None if owner is None else (_str(owner), int(epoch))

    def pages_of(self, owner: str) -> dict[int, int]:
        flat = self._call("pages_of", owner)
        return dict(sorted(zip(flat[0::2], flat[1::2])))

    # ---- shared pages (the prefix cache) ----------------------------------------------------------------
    def cache(self, owner: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> str:
        """Hand `owner`'s written, full pages to the cache entry of scope `salt` (they keep their epochs);
        all or nothing. Returns the entry (an owner whose lease the pool's worker renews)."""
        _check_request_owner(owner)
        entry = cache_entry(salt)
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: cache got {len(pages)} pages but {len(epochs)} epochs")
        def settled():
            cached = [(entry, e, salt) for e in epochs]
            return entry if [state[:3] for state in self._states(pages)] == cached else UNSETTLED

        self._call("cache", owner, entry, salt, _ms(self.lease_ttl_s), len(pages), *pages, *epochs, settled=settled)
        return entry

    def hit(self, reader: str, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> bool:
        """`reader` reads the cached pages (scope `salt`, at those epochs) under its lease: True, or False when
        one left the cache meanwhile (nothing recorded). A page of another scope raises LedgerError."""
        _check_request_owner(reader)
        cache_entry(salt)  # checks the salt
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: hit got {len(pages)} pages but {len(epochs)} epochs")
        return bool(self._call("hit", reader, salt, _ms(self.lease_ttl_s), len(pages), *pages, *epochs))

    def unread(self, reader: str) -> int:
        """Ends every read of `reader`; returns how many pages it read."""
        _check_request_owner(reader)
        return int(self._call("unread", reader))

    def evict(self, salt: str, pages: Sequence[int], epochs: Sequence[int]) -> int:
        """Cached pages of scope `salt` without readers go to the free list (their worker scrubs them, the next
        grant gives a fresh epoch). All or nothing; returns how many pages the entry still holds."""
        pages, epochs = [int(p) for p in pages], [int(e) for e in epochs]
        if len(pages) != len(epochs):
            raise LedgerError(f"pool {self.pool_id}: evict got {len(pages)} pages but {len(epochs)} epochs")
        if not pages:
            return 0
        entry = cache_entry(salt)
        return int(self._call("evict", entry, len(pages), *pages, *epochs,
                              settled=lambda: self._all_free(pages, lambda: len(self.pages_of(entry)))))

    def reads_of(self, reader: str) -> list[int]:
        return [int(p) for p in self._call("reads_of", reader)]

    def _facts(self) -> _Facts:
        (num_pages, free, dirty, owner_flat, epoch_flat, index, names, sets, lease_flat, counter, listed,
         scrubbing, generation, scope_flat, reader_scope_flat, (by_page, by_owner)) = self._call("facts")
        return _Facts(
            num_pages=None if num_pages is None else int(num_pages),
            free=[int(p) for p in free],
            dirty={int(p) for p in dirty},
            page_owner={int(p): _str(o) for p, o in zip(owner_flat[0::2], owner_flat[1::2])},
            page_epoch={int(p): int(e) for p, e in zip(epoch_flat[0::2], epoch_flat[1::2])},
            owner_index={_str(o) for o in index},
            owner_sets={_str(o): {int(p) for p in s} for o, s in zip(names, sets)},
            leases={_str(o): int(float(t)) for o, t in zip(lease_flat[0::2], lease_flat[1::2])},
            epoch_counter=int(counter),
            is_listed=bool(listed),
            scrubbing={int(p): _str(c) for p, c in zip(scrubbing[0::2], scrubbing[1::2])},
            generation=int(generation),
            scope={int(p): _str(x) for p, x in zip(scope_flat[0::2], scope_flat[1::2])},
            reader_scope={_str(o): _str(x) for o, x in zip(reader_scope_flat[0::2], reader_scope_flat[1::2])},
            readers={int(p): {_str(r) for r in rs} for p, rs in by_page},
            reads={_str(o): {int(p) for p in ps} for o, ps in zip(names, by_owner) if ps},
        )

    def snapshot(self) -> dict[int, dict | str]:
        """page -> {"owner", "epoch"} | "free" | "dirty" ("lost" only when the books do not balance)."""
        f = self._facts()
        num_pages = self.num_pages if f.num_pages is None else f.num_pages
        free = set(f.free)
        out: dict[int, dict | str] = {}
        for page in range(num_pages):
            if page in f.page_owner:
                out[page] = {"owner": f.page_owner[page], "epoch": f.page_epoch.get(page, -1)}
                if page in f.scope:
                    out[page].update(scope=f.scope[page], readers=sorted(f.readers.get(page, ())))
            else:
                out[page] = "dirty" if page in f.dirty else "free" if page in free else "lost"
        return out

    def check_integrity(self) -> None:
        """Raise IntegrityError naming every way the pool's records disagree, from one consistent read."""
        problems = _integrity_problems(self._facts())
        if problems:
            raise IntegrityError(
                f"pool {self.pool_id}: " + "; ".join(problems) + ". Stop the pool's worker and restart it: "
                "registering resets the pool (its tensor is fresh; epochs stay monotonic)"
            )


@dataclass(frozen=True)
class PoolCounts:
    """One pool's page counts, read without touching its pages (for /metrics; check_integrity audits)."""

    pool_id: str
    role: str
    num_pages: int
    used: int
    free: int
    dirty: int
    cached: int = 0  # of `used`: pages held by the prefix cache

    @property
    def lost(self) -> int:
        """Pages in none of the three states (0 while the books balance)."""
        return max(0, self.num_pages - self.used - self.free - self.dirty)


def pool_counts(redis_client: redis.Redis, prefix: str = "kvs") -> list[PoolCounts]:
    """Every registered pool's counts in two round trips and O(1) Redis work per pool, whatever its size:
    one MULTI of HMGET meta, LLEN free, SCARD dirty, HLEN page_owner, HLEN scope per pool, so each pool's
    five numbers come from one instant. A pool retired between the listing and the read is left out."""
    pools = sorted(_str(p) for p in redis_client.smembers(ledger_key(prefix)))
    if not pools:
        return []
    with redis_client.pipeline(transaction=True) as pipe:
        for pool_id in pools:
            meta, free, dirty, owners, scope = (ledger_key(prefix, pool_id, part) for part in (
                "meta", "free", "dirty", "page_owner", "scope"))
            pipe.hmget(meta, "role", "num_pages").llen(free).scard(dirty).hlen(owners).hlen(scope)
        replies = pipe.execute()
    out = []
    for i, pool_id in enumerate(pools):
        (role, num_pages), free, dirty, used, cached = replies[5 * i: 5 * i + 5]
        if num_pages is not None:
            out.append(PoolCounts(pool_id, _str(role), int(num_pages), int(used), int(free), int(dirty), int(cached)))
    return out



def owners_held_tokens(redis_client: redis.Redis, owners: Sequence[str], prefix: str = "kvs") -> dict[str, int]:
    """owner -> tokens of KV its pages hold (pages x page size, summed over every registered pool), for the
    per-tenant budget (inference.tenant_budget). Two round trips: one SCARD per (pool, owner) and one HGET
    of each pool's page size, so O(pools x owners) whatever the pools' sizes; owners holding nothing map to 0."""
    owners = list(owners)
    pools = sorted(_str(p) for p in redis_client.smembers(ledger_key(prefix))) if owners else []
    held = dict.fromkeys(owners, 0)
    if not pools:
        return held
    with redis_client.pipeline(transaction=True) as pipe:
        for pool_id in pools:
            pipe.hget(ledger_key(prefix, pool_id, "meta"), "page_size")
            for owner in owners:
                pipe.scard(ledger_key(prefix, pool_id, "owner:") + owner)
        replies = pipe.execute()
    stride = 1 + len(owners)
    for i in range(len(pools)):
        page_size, counts = replies[i * stride], replies[i * stride + 1: (i + 1) * stride]
        if page_size is None:
            continue  # retired between the listing and the read
        for owner, n in zip(owners, counts):
            held[owner] += int(n) * int(page_size)
    return held

def _repeated(items) -> list:
    return sorted(x for x, count in Counter(items).items() if count > 1)


def _integrity_problems(f: _Facts) -> list[str]:
    if f.num_pages is None:
        return ["its meta hash is missing (not registered, or the keys were deleted or evicted)"]
    problems = []
    free, owned, dirty, epochs = set(f.free), f.page_owner.keys(), f.dirty, f.page_epoch
    if twice_free := _repeated(f.free):
        problems.append(f"pages on the free list twice: {_few(twice_free)}")
    listers = defaultdict(list)  # page -> owners whose page set lists it
    for owner, pages in sorted(f.owner_sets.items()):
        for page in pages:
            listers[page].append(owner)
    seen = free | dirty | owned | epochs.keys() | listers.keys()
    if out_of_range := sorted(p for p in seen if not 0 <= p < f.num_pages):
        problems.append(f"page ids outside 0..{f.num_pages - 1}: {_few(out_of_range)}")
    for what, a, b in (("free and owned", free, owned), ("free and dirty", free, dirty),
                       ("dirty and owned", dirty, owned)):
        if a & b:
            problems.append(f"pages both {what}: {_few(sorted(a & b))}")
    if len(free) + len(owned) + len(dirty) != f.num_pages:
        problems.append(f"free {len(free)} + owned {len(owned)} + dirty {len(dirty)} != total {f.num_pages}")
    if lost := sorted(set(range(f.num_pages)) - seen):
        problems.append(f"pages in no state: {_few(lost)}")
    if owned != epochs.keys():
        problems.append(f"pages with an owner or an epoch but not both: {_few(sorted(owned ^ epochs.keys()))}")
    if twice := [(p, o) for p, o in sorted(listers.items()) if len(o) > 1]:
        problems.append(f"pages listed by two owners: {_few(twice)}")
    if disagree := [
        (p, f.page_owner.get(p), listers.get(p, []))
        for p in sorted(owned | listers.keys())
        if len(listers.get(p, [])) < 2 and listers.get(p) != [f.page_owner.get(p)]
    ]:
        problems.append(f"owner page sets disagree with page->owner for (page, owner, listed by): "
                        f"{_few(disagree)}")
    holders = {o for o, pages in f.owner_sets.items() if pages} | {o for o, pages in f.reads.items() if pages}
    problems += _shared_problems(f)
    if f.owner_index != holders:
        problems.append(f"owner index {sorted(f.owner_index)} != owners holding pages {sorted(holders)}")
    if unleased := sorted(holders - f.leases.keys()):
        problems.append(f"owners holding pages without a lease (never reaped): {_few(unleased)}")
    if idle := sorted(f.leases.keys() - holders):
        problems.append(f"leases of owners holding nothing: {_few(idle)}")
    if epochs and max(epochs.values()) > f.epoch_counter:
        problems.append(
            f"epoch counter {f.epoch_counter} is behind granted epoch {max(epochs.values())}: "
            "fencing tokens would repeat"
        )
    if shared := _repeated(epochs.values()):
        problems.append(f"pages share an epoch: {_few(shared)}")
    if claimed_clean := sorted(f.scrubbing.keys() - dirty):
        problems.append(f"pages claimed for scrubbing that are not dirty: {_few(claimed_clean)}")
    if not f.is_listed:
        problems.append("the pool is missing from the pools set")
    return problems


def _shared_problems(f: _Facts) -> list[str]:
    """The prefix cache's records: each cached page owned by the one entry of its scope, every reader of
    a page inside that page's scope and under a lease, readers and reads mirroring each other."""
    problems = []
    if bad := [(p, f.page_owner.get(p)) for p, salt in sorted(f.scope.items())
               if f.page_owner.get(p) != CACHE_ENTRY_PREFIX + salt]:
        problems.append(f"cached pages not owned by their scope's cache entry (page, owner): {_few(bad)}")
    if unscoped := sorted(p for p, o in f.page_owner.items()
                          if o.startswith(CACHE_ENTRY_PREFIX) and p not in f.scope):
        problems.append(f"pages of a cache entry without a scope: {_few(unscoped)}")
    if stray := sorted(p for p, rs in f.readers.items() if rs and p not in f.scope):
        problems.append(f"readers of pages that are not cached: {_few(stray)}")
    pairs = {(r, p) for p, rs in f.readers.items() for r in rs}
    if pairs != {(r, p) for r, ps in f.reads.items() for p in ps}:
        problems.append(f"readers and reads disagree: {_few(sorted(pairs ^ {(r, p) for r, ps in f.reads.items() for p in ps}))}")
    if outside := sorted((r, p) for r, p in pairs if p in f.scope and f.reader_scope.get(r) != f.scope[p]):
        problems.append(f"reads outside the reader's scope (reader, page): {_few(outside)}")
    if unleased := sorted({r for r, _ in pairs} - f.leases.keys()):
        problems.append(f"readers without a lease: {_few(unleased)}")
    if own := sorted((r, p) for r, p in pairs if f.page_owner.get(p) == r):
        problems.append(f"owners reading their own pages as shared (reader, page): {_few(own)}")
    if idle := sorted(f.reader_scope.keys() - {r for r, _ in pairs}):
        problems.append(f"reader scopes of owners reading nothing: {_few(idle)}")
    return problems


def judge_eviction_policy(policy: str) -> None:
    """Raise LedgerError unless `policy` is noeviction: an evicted ledger key loses pages silently."""
    if policy != "noeviction":
        raise LedgerError(
            f"Redis maxmemory-policy is {policy!r}, so under memory pressure Redis may evict ledger keys and "
            "hand out pages that are in use. Run `redis-cli CONFIG SET maxmemory-policy noeviction` and set "
            "`maxmemory-policy noeviction` in redis.conf so it survives a restart"
        )


def check_eviction_policy(redis_client: redis.Redis) -> None:
    """Read the server's maxmemory-policy and judge it; a server that refuses CONFIG fails too."""
    try:
        reply = redis_client.config_get("maxmemory-policy")
    except ResponseError as e:
        raise LedgerError(
            f"cannot read Redis maxmemory-policy (CONFIG GET refused: {e}). Make sure the server runs with "
            "maxmemory-policy noeviction (managed Redis: set it in the provider's parameter group), or grant "
            "this user CONFIG GET so kvserve can check it"
        ) from None
    judge_eviction_policy(_str(reply.get("maxmemory-policy", "")))


def ledger_from_url(url: str, pool_id: str, prefix: str = "kvs", lease_ttl_s: float = 30.0) -> RedisLedger:
    return RedisLedger(redis.Redis.from_url(url), pool_id, prefix, lease_ttl_s)


def measure_latency(ledger: RedisLedger, num_ops: int = 200, num_pages: int = 1) -> dict[str, float]:
    """p50/p99 microseconds of allocate and free round trips; run it on a pool with spare pages."""
    owner = f"latency-probe:{time.monotonic_ns()}"
    allocate_us, free_us = [], []
    for _ in range(num_ops):
        t0 = time.perf_counter_ns()
        grant = ledger.allocate(owner, num_pages)
        t1 = time.perf_counter_ns()
        if grant is None:
            raise LedgerError(
                f"pool {ledger.pool_id} has fewer than {num_pages} free pages; measure on a sandbox pool"
            )
        ledger.free(owner, grant.pages, grant.epochs)
        allocate_us.append((t1 - t0) / 1000)
        free_us.append((time.perf_counter_ns() - t1) / 1000)

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    return {
        "allocate_p50_us": pct(allocate_us, 0.5),
        "allocate_p99_us": pct(allocate_us, 0.99),
        "free_p50_us": pct(free_us, 0.5),
        "free_p99_us": pct(free_us, 0.99),
    }
