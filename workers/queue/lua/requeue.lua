-- Hand a preempted job back: a new entry under the next generation (or none, to park the
-- request), the old one acknowledged, its decode credit released.
-- KEYS: record, stream (the delivery's), requeue_stream, credits
-- ARGV: stage, token, group, entry_id, job ('' to park), generation (the new one), waiting (the
--       state of a request whose job waits in requeue_stream), now, fields
-- Returns OK, STALE or FINISHED (cancelled meanwhile: acknowledged, not re-queued).
if not current(record, stage, token) then
  add_counters(record, fields)
  return R.STALE
end
ack(stream, group, entry_id)
if TERMINAL[state_of(record)] then
  add_counters(record, fields)
  return R.FINISHED
end
if job ~= '' then
  move(record, waiting, now)
  add_job(requeue_stream, job, record, generation)
else
  move(record, STATE.PREEMPTED, now)
end
release_credit(credits, record)
redis.call('HDEL', record, F.PREEMPT)
redis.call('HINCRBY', record, F.PREEMPTIONS, 1)
redis.call('HSET', record, F.GENERATION, generation)
write_fields(record, fields, now)
notify(record)
return R.OK
