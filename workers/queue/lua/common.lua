-- Functions every script shares. A record is a hash whose every change goes through one of
-- these scripts; each change is announced on the record's events channel, which /events
-- waits on instead of rereading the record.

-- A script's table argument (``arg(table=True)`` in script_slots.py): JSON, or '' for an empty
-- RecordWrite, which most writes are.
local function table_arg(raw)
  if raw == '' then return {set = {}, add = {}} end
  return cjson.decode(raw)
end

local function state_of(record)
  return redis.call('HGET', record, F.STATE)
end

local function generation_of(record)
  return tonumber(redis.call('HGET', record, F.GENERATION) or '0')
end

local function stage_field(prefix, stage)
  return prefix .. ':' .. stage
end

-- The writer holding ``token`` for ``stage`` is current: its token is the stage's fence and its
-- generation is the request's (a resume, re-queue or recompute since its claim makes it stale).
local function current(record, stage, token)
  local fence = tonumber(redis.call('HGET', record, stage_field(STAGE_FIELD.FENCE, stage)) or '0')
  return tonumber(token) == fence
    and math.floor(tonumber(token) / ATTEMPTS_PER_GENERATION) >= generation_of(record)
end

-- Hand a job (its JSON) to ``stream``, with a header of what its claim decides on: the message
-- version, the request's record and the job's generation. ``take.lua`` reads the header and
-- leaves the JSON alone (decoding it was a tenth of a dispatch's time in Valkey).
local function add_job(stream, job, record, generation)
  redis.call('XADD', stream, '*', 'job', job, 'v', MESSAGE_VERSION, 'record', record,
             'gen', generation)
end

local function notify(record)
  redis.call('SPUBLISH', record .. EVENTS_SUFFIX, state_of(record) or '')
end

-- The hot scripts (claim, update, publish) read what they decide on in one HMGET and write in
-- one HSET: every redis.call costs, and these run once or twice per dispatch.

-- What a stage's writer decides on, as one read: the state (false: no record), the
-- generation, the stage's fence, its done flag, and the preemption asked.
local function read_stage(record, stage)
  local v = redis.call('HMGET', record, F.STATE, F.GENERATION,
                       stage_field(STAGE_FIELD.FENCE, stage),
                       stage_field(STAGE_FIELD.DONE, stage), F.PREEMPT, F.ERROR, F.WAITING,
                       F.WATCHERS)
  return {state = v[1], generation = tonumber(v[2] or '0'), fence = tonumber(v[3] or '0'),
          done = v[4], preempt = v[5], error = v[6], waiting = v[7],
          watched = tonumber(v[8] or '0') > 0}
end

-- Latency histogram increments and acknowledgements made while ``batch`` runs: applied once
-- when it ends, so a read of many jobs updates each histogram once and acknowledges each
-- stream's entries in one XACK. The batch is one command, so nothing sees the state between.
local DEFERRED = nil

local function count_latency(latency, bucket, seconds)
  if DEFERRED == nil then
    redis.call('HINCRBY', latency, bucket, 1)
    redis.call('HINCRBYFLOAT', latency, 'sum', seconds)
    redis.call('HINCRBY', latency, 'count', 1)
    return
  end
  local h = DEFERRED.latency[latency]
  if h == nil then
    h = {buckets = {}, sum = 0, count = 0}
    DEFERRED.latency[latency] = h
  end
  h.buckets[bucket] = (h.buckets[bucket] or 0) + 1
  h.sum = h.sum + tonumber(seconds)
  h.count = h.count + 1
end

-- Acknowledge ``entry_id`` of ``stream`` in ``group``.
local function ack(stream, group, entry_id)
  if DEFERRED == nil then
    redis.call('XACK', stream, group, entry_id)
    return
  end
  local by_group = DEFERRED.acks[stream]
  if by_group == nil then
    by_group = {}
    DEFERRED.acks[stream] = by_group
  end
  local ids = by_group[group]
  if ids == nil then
    ids = {}
    by_group[group] = ids
  end
  ids[#ids + 1] = entry_id
end

local function defer()
  DEFERRED = {latency = {}, acks = {}}
end

local function stop_deferring()
  DEFERRED = nil
end

local function apply_deferred()
  local deferred = DEFERRED
  DEFERRED = nil
  if deferred == nil then return end
  for stream, by_group in pairs(deferred.acks) do
    for group, ids in pairs(by_group) do redis.call('XACK', stream, group, unpack(ids)) end
  end
  for latency, h in pairs(deferred.latency) do
    for bucket, n in pairs(h.buckets) do redis.call('HINCRBY', latency, bucket, n) end
    redis.call('HINCRBYFLOAT', latency, 'sum', string.format('%.6f', h.sum))
    redis.call('HINCRBY', latency, 'count', h.count)
  end
end

-- ``current`` over what ``read_stage`` read.
local function is_current(read, token)
  return tonumber(token) == read.fence
    and math.floor(tonumber(token) / ATTEMPTS_PER_GENERATION) >= read.generation
end

-- Move the record from ``from`` (as read) into ``to``, and write the name/value pairs of
-- ``extra`` and a RecordWrite's fields, in one HSET (its counters by HINCRBY).
local function check_move(record, from, to)
  if from and not TRANSITIONS[from][to] then
    error({err = 'ERR diffcache: ' .. record .. ' may not move from ' .. from .. ' to ' .. to})
  end
end

local function transition(record, from, to, now, extra, write)
  check_move(record, from, to)
  local args = {F.STATE, to}
  for _, v in ipairs(extra) do args[#args + 1] = v end
  for name, value in pairs(write.set) do
    args[#args + 1] = name
    args[#args + 1] = value
  end
  args[#args + 1] = F.UPDATED_AT
  args[#args + 1] = now
  redis.call('HSET', record, unpack(args))
  for name, amount in pairs(write.add) do redis.call('HINCRBY', record, name, amount) end
end

-- ``notify`` when the state is known, and only if someone follows the record (``read_stage``
-- read its watchers): most records are never followed, and a PUBLISH costs a call.
local function announce(record, state, read)
  if read.watched then redis.call('SPUBLISH', record .. EVENTS_SUFFIX, state) end
end

-- Move the record into state ``to``. A move the schema does not allow is a bug in a script:
-- it raises before anything is written, since every script moves before it writes.
local function move(record, to, now)
  local from = state_of(record)
  if from and not TRANSITIONS[from][to] then
    error({err = 'ERR diffcache: ' .. record .. ' may not move from ' .. from .. ' to ' .. to})
  end
  redis.call('HSET', record, F.STATE, to, F.UPDATED_AT, now)
end

local function has_fields(write)
  return next(write.set) ~= nil or next(write.add) ~= nil
end

-- Apply a RecordWrite: ``set`` replaces fields, ``add`` increments counters.
local function write_fields(record, write, now)
  for name, value in pairs(write.set) do redis.call('HSET', record, name, value) end
  for name, amount in pairs(write.add) do redis.call('HINCRBY', record, name, amount) end
  redis.call('HSET', record, F.UPDATED_AT, now)
end

-- Only the counters of a RecordWrite: what an attempt looked up counts even when its result is
-- refused (stale, a duplicate, or the request finished meanwhile), as the cache counters
-- counted it. A terminal record is final: what arrives after its end is kept apart, under
-- ``late:<counter>``, so the record's own counters never change once it has ended while the
-- records still sum to what the cache counters counted.
local function add_counters(record, write)
  local prefix = ''
  if TERMINAL[state_of(record) or ''] then prefix = LATE_PREFIX .. ':' end
  for name, amount in pairs(write.add) do
    redis.call('HINCRBY', record, prefix .. name, amount)
  end
end

local function clear_fields(record, names)
  for _, name in ipairs(names) do redis.call('HDEL', record, name) end
end

-- The one place a decode credit is given back.
local function release_credit(credits, record)
  redis.call('ZREM', credits, record)
end

-- Drop members of a set of record keys whose request no longer counts (finished, parked or
-- gone) and answer how many remain. Unbounded, only the oldest few are looked at: callers
-- without a bound pay O(1), yet the set cannot grow without limit.
local function live_members(set, bounded)
  local last = -1
  if not bounded then last = 31 end
  for _, member in ipairs(redis.call('ZRANGE', set, 0, last)) do
    local state = redis.call('HGET', member, F.STATE)
    if not state or IDLE[state] then redis.call('ZREM', set, member) end
  end
  return redis.call('ZCARD', set)
end

-- Count ``record`` as queued or running against the bounds (-1: none) on the overall and the
-- tenant's active sets; OK, OVER_BOUND or OVER_TENANT_BOUND.
local function admit(active, tenant_active, record, score, bound, tenant_bound)
  bound, tenant_bound = tonumber(bound), tonumber(tenant_bound)
  local tenant_live = live_members(tenant_active, tenant_bound >= 0)
  if tenant_bound >= 0 and tenant_live >= tenant_bound then return R.OVER_TENANT_BOUND end
  local overall_live = live_members(active, bound >= 0)
  if bound >= 0 and overall_live >= bound then return R.OVER_BOUND end
  redis.call('ZADD', active, score, record)
  redis.call('ZADD', tenant_active, score, record)
  return R.OK
end

-- Claim ``stage`` of ``record`` for the delivery holding ``token``, fenced: the one claim that
-- claim.lua and take.lua make. Returns OK, MISSING, SUPERSEDED, FINISHED, ALREADY_DONE or STALE.
local function claim_stage(record, stage, token, generation, running, now, fields)
  local read = read_stage(record, stage)
  if not read.state then return R.MISSING end
  if tonumber(generation) < read.generation then return R.SUPERSEDED end
  if TERMINAL[read.state] then return R.FINISHED end
  if read.done then return R.ALREADY_DONE end
  if tonumber(token) < read.fence then return R.STALE end
  transition(record, read.state, running, now, {stage_field(STAGE_FIELD.FENCE, stage), token},
             fields)
  announce(record, running, read)
  return R.OK
end
