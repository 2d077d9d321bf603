-- Give up on a delivery: the job goes to the dead letters and the request fails, unless it
-- finished meanwhile or a newer generation superseded the job (which then fails nothing).
-- KEYS: record, stream, dead_letters
-- ARGV: group, entry_id, job, reason, now, generation (the job's)
-- Returns OK.
redis.call('XADD', dead_letters, '*', 'job', job, 'reason', reason)
local state = state_of(record)
if state and not TERMINAL[state] and tonumber(generation) >= generation_of(record) then
  move(record, STATE.FAILED, now)
  redis.call('HSET', record, F.ERROR, reason)
  notify(record)
end
ack(stream, group, entry_id)
return R.OK
