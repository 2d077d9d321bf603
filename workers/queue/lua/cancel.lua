-- Cancel a request: its workers stop at their next step boundary. One script, so a request
-- that finishes at the same moment is never marked CANCELLED after DONE.
-- KEYS: record
-- ARGV: now
-- Returns OK, MISSING or FINISHED.
local state = state_of(record)
if not state then return R.MISSING end
if TERMINAL[state] then return R.FINISHED end
move(record, STATE.CANCELLED, now)
notify(record)
return R.OK
