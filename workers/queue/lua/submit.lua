-- Accept a request: its record and its first stream entry, admitted against the bounds on
-- queued plus running requests, so concurrent submits can never overshoot them.
-- KEYS: record, active, tenant_active, index, encode_stream
-- ARGV: score (admission time, unix ms), bound, tenant_bound (-1: none), job, request_id, now,
--       fields
-- Returns OK, SEEN (accepted before: nothing written), OVER_BOUND or OVER_TENANT_BOUND.
if redis.call('EXISTS', record) == 1 then return R.SEEN end
local admitted = admit(active, tenant_active, record, score, bound, tenant_bound)
if admitted ~= R.OK then return admitted end
write_fields(record, fields, now)
redis.call('ZADD', index, score, request_id)
add_job(encode_stream, job, record, 0)
return R.OK
