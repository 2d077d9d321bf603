-- Ask the worker denoising a request to stop at its next step boundary.
-- KEYS: record
-- ARGV: mode (a PreemptMode), now
-- Returns OK, MISSING or NOT_ALLOWED (the request is not denoising).
local state = state_of(record)
if not state then return R.MISSING end
if state ~= STATE.DENOISING then return R.NOT_ALLOWED end
redis.call('HSET', record, F.PREEMPT, mode, F.UPDATED_AT, now)
notify(record)
return R.OK
