-- Publish a stage's result once: hand the next stage its job, move the request on, record the
-- stage's latency and acknowledge the delivery, all or nothing.
-- KEYS: record, stream (the delivery's), next_stream (the next stage's; the record for none),
--       latency (the stage and class's histogram)
-- ARGV: stage, token, group, entry_id, next_job ('' for none), finished (the state to move
--       into), now, bucket (the histogram field of seconds), seconds, fields
-- Returns OK, STALE, ALREADY_DONE or FINISHED (cancelled or failed meanwhile: acknowledged).
-- Whatever happens to the result, the lookups the attempt made were made: the record counts
-- them as the cache counters did.
if not current(record, stage, token) then
  add_counters(record, fields)
  return R.STALE
end
if redis.call('HGET', record, stage_field(STAGE_FIELD.DONE, stage)) then
  add_counters(record, fields)
  redis.call('XACK', stream, group, entry_id)
  return R.ALREADY_DONE
end
if TERMINAL[state_of(record)] then
  add_counters(record, fields)
  redis.call('XACK', stream, group, entry_id)
  return R.FINISHED
end
move(record, finished, now)
if next_job ~= '' then redis.call('XADD', next_stream, '*', 'job', next_job) end
redis.call('HSET', record, stage_field(STAGE_FIELD.DONE, stage), '1')
-- A preemption asked too late has nothing to stop; an earlier attempt's error or wait is over.
redis.call('HDEL', record, F.PREEMPT, F.ERROR, F.WAITING)
write_fields(record, fields, now)
redis.call('XACK', stream, group, entry_id)
redis.call('HINCRBY', latency, bucket, 1)
redis.call('HINCRBYFLOAT', latency, 'sum', seconds)
redis.call('HINCRBY', latency, 'count', 1)
notify(record)
return R.OK
