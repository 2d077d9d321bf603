-- Write a running stage's progress, if the writer is still current; with no fields, only ask
-- whether the request was cancelled or asked to make way.
-- KEYS: record
-- ARGV: stage, token, now, fields
-- Returns {OK or STALE, the request's state, the preemption asked ('' for none)}.
local read = read_stage(record, stage)
if not is_current(read, token) then
  add_counters(record, fields)  -- lookups a stale attempt made were made all the same
  return {R.STALE, '', ''}
end
-- A current attempt of a request cancelled meanwhile (a cancel moves no fence) still writes:
-- the checkpoint it stops at is what a resume or a branch starts from.
if has_fields(fields) then
  transition(record, nil, read.state, now, {}, fields)
  announce(record, read.state, read)
end
return {R.OK, read.state, read.preempt or ''}
