-- Take a decode credit for a request (idempotent for a holder). Holders whose request no
-- longer runs give theirs back here, so an abandoned job cannot leak a credit.
-- KEYS: credits, record
-- ARGV: limit, now_ms
-- Returns OK or OVER_BOUND (none is free).
if redis.call('ZSCORE', credits, record) then return R.OK end
for _, holder in ipairs(redis.call('ZRANGE', credits, 0, -1)) do
  local state = redis.call('HGET', holder, F.STATE)
  if not state or IDLE[state] then release_credit(credits, holder) end
end
if redis.call('ZCARD', credits) >= tonumber(limit) then return R.OVER_BOUND end
redis.call('ZADD', credits, now_ms, record)
return R.OK
