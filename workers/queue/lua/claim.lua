-- Claim a stage of a request for one delivery attempt, fenced by the attempt's token.
-- KEYS: record
-- ARGV: stage, token, generation (the job's), running (the state to move into), now, fields
-- Returns OK, MISSING, SUPERSEDED, FINISHED, ALREADY_DONE or STALE.
local state = state_of(record)
if not state then return R.MISSING end
if tonumber(generation) < generation_of(record) then return R.SUPERSEDED end
if TERMINAL[state] then return R.FINISHED end
if redis.call('HGET', record, stage_field(STAGE_FIELD.DONE, stage)) then return R.ALREADY_DONE end
local fence = tonumber(redis.call('HGET', record, stage_field(STAGE_FIELD.FENCE, stage)) or '0')
if tonumber(token) < fence then return R.STALE end
move(record, running, now)
redis.call('HSET', record, stage_field(STAGE_FIELD.FENCE, stage), token)
write_fields(record, fields, now)
notify(record)
return R.OK
