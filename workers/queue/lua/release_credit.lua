-- Give a request's decode credit back (decode published, or the job stepped aside).
-- KEYS: credits, record
-- ARGV: (none)
-- Returns OK.
release_credit(credits, record)
return R.OK
