-- Publish a stage's result once: hand the next stage its job, move the request on, record the
-- stage's latency (and its seconds on the record) and acknowledge the delivery, all or nothing.
-- KEYS: record, stream (the delivery's), next_stream (the next stage's; the record for none),
--       latency (the stage and class's histogram)
-- ARGV: stage, token, group, entry_id, next_job ('' for none), finished (the state to move
--       into), now, bucket (the histogram field of seconds), seconds, fields
-- Returns OK, STALE, ALREADY_DONE or FINISHED (cancelled or failed meanwhile: acknowledged).
-- Whatever happens to the result, the lookups the attempt made were made: the record counts
-- them as the cache counters did.
local read = read_stage(record, stage)
if not is_current(read, token) then
  add_counters(record, fields)
  return R.STALE
end
if read.done or TERMINAL[read.state] then
  add_counters(record, fields)
  ack(stream, group, entry_id)
  if read.done then return R.ALREADY_DONE end
  return R.FINISHED
end
check_move(record, read.state, finished)  -- before anything is written, as ``move`` does
if next_job ~= '' then add_job(next_stream, next_job, record, read.generation) end
-- A preemption asked too late has nothing to stop; an earlier attempt's error or wait is over.
if read.preempt or read.error or read.waiting then
  redis.call('HDEL', record, F.PREEMPT, F.ERROR, F.WAITING)
end
transition(record, read.state, finished, now,
           {stage_field(STAGE_FIELD.DONE, stage), '1', stage_field(STAGE_FIELD.SECONDS, stage),
            seconds}, fields)
ack(stream, group, entry_id)
count_latency(latency, bucket, seconds)
announce(record, finished, read)
return R.OK
