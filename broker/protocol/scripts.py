"""Every Lua script Relay runs against the Redis layout of broker/protocol/keys.py: the atomic steps
of the replay queue. Each names its KEYS and ARGV; the callers are in broker/client/queues.py.
"""

# The records of a run are bounded by a window of group ids (``record_window``, 0 = never trimmed): a
# set of ids (``seen``, ``trained``) holds the current generation; when it reaches the window it becomes
# the previous generation (RENAME, replacing the one before) and a new one starts, so membership is
# asked of both and between window and 2 x window of the latest ids are remembered. The audit counts
# (accepted, committed, dropped) are counters, exact for the whole run whatever was trimmed.

# The valid groups of one ingest batch, in arrival order, in one atomic step. Each group's message is not
# an argument (Redis's Lua copies every argument into a Lua string, ~1.5 ns a byte: about three times
# what the whole append costs otherwise): the caller SETs it under a ``staged`` key (with an expiry) in
# the same MULTI, and the script renames it to ``payload:<stream id>`` once the entry exists, or deletes it.
# KEYS: seen set, trajectories stream, broker stats, queue bytes counter, queue sizes hash, previous seen set,
# then the staged key of each group, in order.
# ARGV[1]: max_queue_groups, ARGV[2]: max_queue_bytes, ARGV[3]: the learner's consumer group, ARGV[4]: the
# record window, ARGV[5]: the payload keys' prefix (Keys.payload_prefix), then 4 per group: group id, the
# message's size in bytes, min version, generator.
# Per group the reply is 'B' (busy: the unread groups are at the bound, or this group's bytes would take
# the stream past its byte bound; nothing stored, nothing checked for duplicates), 'D' (duplicate: the
# id was appended before) or the new entry's id.
# Unread = XLEN - the learner's pending count, counted up as the batch appends: the bound is exact. The
# byte bound counts every group in the stream (read or not: both hold Redis memory); a group alone
# larger than the bound is accepted into an empty stream, so no valid group waits forever.
APPEND_BATCH = """
local waiting = redis.call('XLEN', KEYS[2])
if waiting > 0 then
  local p = redis.pcall('XPENDING', KEYS[2], ARGV[3])
  if type(p) == 'table' and p.err == nil then waiting = waiting - tonumber(p[1]) end
end
local bound, max_bytes, prefix = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[5]
local held = tonumber(redis.call('GET', KEYS[4]) or '0')
local out, n, k = {}, {ok = 0, dup = 0, busy = 0}, 6
for i = 6, #ARGV, 4 do
  k = k + 1
  local size = tonumber(ARGV[i + 1])
  if waiting >= bound or (held > 0 and held + size > max_bytes) then
    out[#out + 1] = 'B'; n.busy = n.busy + 1
    redis.call('DEL', KEYS[k])
  elseif redis.call('SISMEMBER', KEYS[6], ARGV[i]) == 1 or redis.call('SADD', KEYS[1], ARGV[i]) == 0 then
    out[#out + 1] = 'D'; n.dup = n.dup + 1
    redis.call('DEL', KEYS[k])
  else
    local eid = redis.call('XADD', KEYS[2], '*', 'gid', ARGV[i], 'v', ARGV[i + 2], 'gen', ARGV[i + 3])
    redis.call('RENAME', KEYS[k], prefix .. eid)
    redis.call('PERSIST', prefix .. eid)
    out[#out + 1] = eid
    redis.call('HSET', KEYS[5], ARGV[i], size)
    held = held + size
    waiting = waiting + 1; n.ok = n.ok + 1
  end
end
if n.ok > 0 then redis.call('SET', KEYS[4], held) end
if n.ok > 0 then redis.call('HINCRBY', KEYS[3], 'accepted', n.ok) end
if n.dup > 0 then redis.call('HINCRBY', KEYS[3], 'duplicate', n.dup) end
if n.busy > 0 then redis.call('HINCRBY', KEYS[3], 'busy', n.busy) end
local window = tonumber(ARGV[4])
if window > 0 and redis.call('SCARD', KEYS[1]) >= window then redis.call('RENAME', KEYS[1], KEYS[6]) end
return out
"""

# Staleness admission control (AReaL's rule, with drops and rejections given back).
# in flight = issued - (consumed by the learner: trained + dropped) - (rejected by the broker);
# admit while in flight < (eta + 1) * batch_groups, i.e. issued < (eta + steps + 1) * batch without drops.
# KEYS: admission hash, learner stats, broker stats, issued counter. ARGV[1]: prompts wanted.
# The room left under the bound (ARGV[1] when the learner set no admission parameters):
_ROOM = """
local B = tonumber(redis.call('HGET', KEYS[1], 'batch_groups') or '0')
local room = tonumber(ARGV[1])
if B > 0 then
  local eta = tonumber(redis.call('HGET', KEYS[1], 'eta'))
  local consumed = tonumber(redis.call('HGET', KEYS[2], 'consumed') or '0')
  local rejected = tonumber(redis.call('HGET', KEYS[3], 'rejected_total') or '0')
  local issued = tonumber(redis.call('GET', KEYS[4]) or '0')
  room = consumed + rejected + (eta + 1) * B - issued
end
local grant = math.max(0, math.min(tonumber(ARGV[1]), room))
"""

# Admission alone: the grant, counted as issued (a producer taking prompts from elsewhere gives back
# what it did not use). KEYS, ARGV as above.
ADMIT = (
    _ROOM
    + """if grant > 0 then redis.call('INCRBY', KEYS[4], grant) end
return grant
"""
)

# Admission and the read of new prompts in one step, so that ``issued`` counts exactly the prompts read:
# a producer killed at any moment holds no grant it did not use. KEYS as above, then the prompts stream;
# ARGV[2]: the consumer group, ARGV[3]: the consumer. Reply: {grant, entries as XREADGROUP gives them}
# (grant 0: at the bound; grant > 0 and no entries: the stream is empty).
ADMIT_CLAIM = (
    _ROOM
    + """if grant == 0 then return {0, {}} end
local r = redis.call('XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', grant, 'STREAMS', KEYS[5], '>')
local entries = r and r[1][2] or {}
if #entries > 0 then redis.call('INCRBY', KEYS[4], #entries) end
return {grant, entries}
"""
)

# A producer's claims renewed while it holds them (docs/protocol.md 7.2): each entry still pending for
# this consumer has its idle time reset (XCLAIM JUSTID: no delivery counted), so ``claim_abandoned`` never
# takes a prompt from a live producer whose batch runs longer than the claim timeout. An entry another
# consumer took over (this one was stopped for longer than the timeout) or that is gone stays as it is.
# KEYS[1]: the stream. ARGV[1]: the consumer group, ARGV[2]: the consumer, then entry ids.
# Reply: the ids renewed.
RENEW_CLAIMS = """
local out = {}
for i = 3, #ARGV do
  if #redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1, ARGV[2]) > 0 then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    out[#out + 1] = ARGV[i]
  end
end
return out
"""

# The learner's commit of trained groups (exactly-once training, docs/protocol.md 7.3).
# KEYS: trained set, trained log, trajectories stream, counted set, queue bytes, queue sizes, previous
# trained set, learner stats, then the payload key of each entry. ARGV: step, consumer group, record
# window, then pairs (stream id, group id).
# Idempotent: a group already recorded is only acknowledged again (its bytes were given back the first
# time). ``committed`` counts the groups recorded; the log keeps about the window's newest entries.
COMMIT = """
local window, n = tonumber(ARGV[3]), 0
for i = 4, #ARGV, 2 do
  local eid, gid = ARGV[i], ARGV[i + 1]
  if redis.call('SISMEMBER', KEYS[7], gid) == 0 and redis.call('SADD', KEYS[1], gid) == 1 then
    if window > 0 then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', window, '*', 'gid', gid, 'step', ARGV[1])
    else
      redis.call('XADD', KEYS[2], '*', 'gid', gid, 'step', ARGV[1])
    end
    n = n + 1
  end
  redis.call('XACK', KEYS[3], ARGV[2], eid)
  redis.call('XDEL', KEYS[3], eid)
  redis.call('DEL', KEYS[8 + (i - 2) / 2])
  redis.call('SREM', KEYS[4], gid)
  local size = redis.call('HGET', KEYS[6], gid)
  if size then redis.call('HDEL', KEYS[6], gid); redis.call('DECRBY', KEYS[5], size) end
end
if n > 0 then redis.call('HINCRBY', KEYS[8], 'committed', n) end
if window > 0 and redis.call('SCARD', KEYS[1]) >= window then redis.call('RENAME', KEYS[1], KEYS[7]) end
return n
"""

# `consumed` (admission control, docs/protocol.md 7.4) counts each group once, even when a restarted
# learner trains again what its checkpoint did not hold. KEYS: counted set, learner stats.
# ARGV: group ids. A trained group is counted when first added to `counted`; the commit removes it.
COUNT_TRAINED = """
local n = 0
for i = 1, #ARGV do n = n + redis.call('SADD', KEYS[1], ARGV[i]) end
if n > 0 then redis.call('HINCRBY', KEYS[2], 'consumed', n) end
return n
"""

# A drop in one step: recorded, acknowledged, deleted and counted (unless it was counted when a
# learner before a restart trained it). KEYS: dropped log, trajectories stream, counted set, learner
# stats, queue bytes, queue sizes, then the payload key of each entry. ARGV: consumer group, record
# window, then triples (stream id, group id, reason). ``dropped`` counts the groups dropped (an entry
# already gone is not counted again); the log keeps about the window's newest entries.
DROP = """
local n, window, gone = 0, tonumber(ARGV[2]), 0
for i = 3, #ARGV, 3 do
  local eid, gid = ARGV[i], ARGV[i + 1]
  if window > 0 then
    redis.call('XADD', KEYS[1], 'MAXLEN', '~', window, '*', 'gid', gid, 'reason', ARGV[i + 2], 'stream_id', eid)
  else
    redis.call('XADD', KEYS[1], '*', 'gid', gid, 'reason', ARGV[i + 2], 'stream_id', eid)
  end
  redis.call('XACK', KEYS[2], ARGV[1], eid)
  gone = gone + redis.call('XDEL', KEYS[2], eid)
  redis.call('DEL', KEYS[6 + i / 3])
  if redis.call('SREM', KEYS[3], gid) == 0 then n = n + 1 end
  local size = redis.call('HGET', KEYS[6], gid)
  if size then redis.call('HDEL', KEYS[6], gid); redis.call('DECRBY', KEYS[5], size) end
end
if n > 0 then redis.call('HINCRBY', KEYS[4], 'consumed', n) end
if gone > 0 then redis.call('HINCRBY', KEYS[4], 'dropped', gone) end
return n
"""
