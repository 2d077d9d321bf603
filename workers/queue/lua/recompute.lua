-- Send a request back to the stage that produces an input the store lost, under the next
-- generation: neither a failed delivery nor a preemption. Past max_recomputes it fails.
-- KEYS: record, stream (the delivery's), redo_stream, credits
-- ARGV: stage, token, group, entry_id, job (the redo job), generation (the new one), waiting
--       (the state of a request whose job waits in redo_stream), now, lost (the key kind),
--       max_recomputes, reason (the error when over the bound), cleared (fields to delete)
-- Returns OK, STALE, FINISHED or OVER_BOUND (the request failed).
if not current(record, stage, token) then return R.STALE end
ack(stream, group, entry_id)
if TERMINAL[state_of(record)] then return R.FINISHED end
release_credit(credits, record)
redis.call('HINCRBY', record, stage_field(KIND_FIELD.RECOMPUTED, lost), 1)
if redis.call('HINCRBY', record, F.RECOMPUTES, 1) > tonumber(max_recomputes) then
  move(record, STATE.FAILED, now)
  redis.call('HSET', record, F.ERROR, reason)
  notify(record)
  return R.OVER_BOUND
end
move(record, waiting, now)
clear_fields(record, cleared)
add_job(redo_stream, job, record, generation)
redis.call('HSET', record, F.GENERATION, generation)
notify(record)
return R.OK
