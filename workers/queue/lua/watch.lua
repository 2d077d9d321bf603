-- Count a follower of the record's events in or out, only while the record exists: a count on
-- a request that is gone (or not yet there) must not make a record of its own.
-- KEYS: record
-- ARGV: delta (1 or -1)
-- Returns the followers now (0 for no record).
if redis.call('EXISTS', record) == 0 then return 0 end
return redis.call('HINCRBY', record, F.WATCHERS, tonumber(delta))
