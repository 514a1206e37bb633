"""The ledger's Lua scripts (every mutation of a pool is one of them) and, for each, whether it may run again
after a dropped connection lost its reply (REPEAT, read by RedisLedger._call through inference.retry)."""
from dataclasses import dataclass

# Every script gets its pool's KEYS in the order of keys.pool_keys and ARGV[1..2] = owner-key prefix, pool id.
PREAMBLE = """
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

SCRIPTS = {
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
    # ARGV: claimer, pages in hand... Claims every dirty page nobody has claimed, and answers with them the
    # pages this claimer claimed before but does not list in hand (a claim whose reply was lost); sorted.
    # A page in hand is never handed out again, so two beats never give a scrubber the same page twice.
    "claim_dirty": """
if not registered() then return unregistered() end
local claimer, in_hand, out = ARGV[3], {}, {}
for i = 4, #ARGV do in_hand[ARGV[i]] = true end
for _, page in ipairs(redis.call('SMEMBERS', dirty)) do
  if redis.call('HSETNX', scrubbing, page, claimer) == 1
      or (not in_hand[page] and redis.call('HGET', scrubbing, page) == claimer) then
    out[#out + 1] = tonumber(page)
  end
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
SCRIPTS.update(_SHARED_SCRIPTS)
# ARGV: pages... For each page {owner or false, epoch or false, scope or false, on the free list 0/1}: what a
# repeated script reads back to learn whether its first run took effect (RedisLedger._call).
SCRIPTS["states"] = """
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
    "claim_dirty": Repeat("same", "a repeat answers the first run's claims too: the claimer's, not in hand"),
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
