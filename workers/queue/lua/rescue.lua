-- Re-queue at encode, under the next generation, a request that the watchdog found with no
-- live owner and no entry anyone will deliver: its dead entries acknowledged, its decode credit
-- released, the rescue counted on the record and cluster-wide. Only if the record is exactly as
-- the watchdog saw it, so a request that moved meanwhile is left alone.
-- KEYS: record, encode_stream, credits, rescued, streams (of the dead entries, one each)
-- ARGV: seen_state, seen_updated_at, generation (the new one), job, now, cleared (fields its
--       next generation redoes), counter (the field of rescued to count in), groups (per
--       stream), entry_ids (per stream)
-- Returns OK, MISSING or SUPERSEDED (it changed since the watchdog saw it).
local state = state_of(record)
if not state then return R.MISSING end
if state ~= seen_state or generation_of(record) + 1 ~= tonumber(generation)
    or redis.call('HGET', record, F.UPDATED_AT) ~= seen_updated_at then
  return R.SUPERSEDED
end
for i, stream in ipairs(streams) do redis.call('XACK', stream, groups[i], entry_ids[i]) end
move(record, STATE.QUEUED, now)
clear_fields(record, cleared)
redis.call('HDEL', record, F.PREEMPT, F.WAITING)
redis.call('HSET', record, F.GENERATION, generation)
redis.call('HINCRBY', record, F.RESCUES, 1)
release_credit(credits, record)
redis.call('HINCRBY', rescued, counter, 1)
add_job(encode_stream, job, record, generation)
notify(record)
return R.OK
