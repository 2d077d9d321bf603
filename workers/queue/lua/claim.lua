-- Claim a stage of a request for one delivery attempt, fenced by the attempt's token.
-- KEYS: record
-- ARGV: stage, token, generation (the job's), running (the state to move into), now, fields
-- Returns OK, MISSING, SUPERSEDED, FINISHED, ALREADY_DONE or STALE.
local read = read_stage(record, stage)
if not read.state then return R.MISSING end
if tonumber(generation) < read.generation then return R.SUPERSEDED end
if TERMINAL[read.state] then return R.FINISHED end
if read.done then return R.ALREADY_DONE end
if tonumber(token) < read.fence then return R.STALE end
transition(record, read.state, running, now, {stage_field(STAGE_FIELD.FENCE, stage), token},
           fields)
announce(record, running, read)
return R.OK
