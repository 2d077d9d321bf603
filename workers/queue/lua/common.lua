-- Functions every script shares. A record is a hash whose every change goes through one of
-- these scripts; each change is announced on the record's events channel, which /events
-- waits on instead of rereading the record.

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

local function notify(record)
  redis.call('PUBLISH', record .. EVENTS_SUFFIX, state_of(record) or '')
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
