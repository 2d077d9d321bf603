-- Put a request back at the encode stage under its next generation: a resume (from PREEMPTED,
-- FAILED or CANCELLED), or a DONE request whose output was lost (it is seeded, so the output
-- comes out the same).
-- KEYS: record, encode_stream
-- ARGV: start (the states it may start from), generation (the new one), job, now, cleared
--       (fields its next generation redoes), fields
-- Returns OK, MISSING, NOT_ALLOWED or SUPERSEDED (it changed meanwhile).
local state = state_of(record)
if not state then return R.MISSING end
local allowed = false
for _, s in ipairs(start) do allowed = allowed or s == state end
if not allowed then return R.NOT_ALLOWED end
if generation_of(record) + 1 ~= tonumber(generation) then return R.SUPERSEDED end
move(record, STATE.QUEUED, now)
clear_fields(record, cleared)
redis.call('HSET', record, F.GENERATION, generation)
write_fields(record, fields, now)
add_job(encode_stream, job, record, generation)
notify(record)
return R.OK
