-- Write a running stage's progress, if the writer is still current; with no fields, only ask
-- whether the request was cancelled or asked to make way.
-- KEYS: record
-- ARGV: stage, token, now, fields
-- Returns {OK or STALE, the request's state, the preemption asked ('' for none)}.
if not current(record, stage, token) then
  add_counters(record, fields)  -- lookups a stale attempt made were made all the same
  return {R.STALE, '', ''}
end
if has_fields(fields) then
  write_fields(record, fields, now)
  notify(record)
end
return {R.OK, state_of(record), redis.call('HGET', record, F.PREEMPT) or ''}
