-- Claim a stage of a request for one delivery attempt, fenced by the attempt's token.
-- KEYS: record
-- ARGV: stage, token, generation (the job's), running (the state to move into), now, fields
-- Returns OK, MISSING, SUPERSEDED, FINISHED, ALREADY_DONE or STALE.
return claim_stage(record, stage, token, generation, running, now, fields)
