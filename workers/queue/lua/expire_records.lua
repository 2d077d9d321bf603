-- Delete finished records whose last change is past the cutoff, with their index entries.
-- Records are deleted here rather than given an EXPIRE: a FAILED or CANCELLED request can be
-- resumed, and a TTL set before that would delete it mid-flight. The state and the last change
-- are read at the moment of deletion, so this cannot race a resume or a late write.
-- KEYS: index (the tenant's request index), records (one per id)
-- ARGV: cutoff (unix seconds), ids
-- Returns 1 per request whose record is gone, 0 per one kept.
local gone = {}
for i, key in ipairs(records) do
  local state, updated, created = unpack(redis.call('HMGET', key, F.STATE, F.UPDATED_AT,
                                                    F.CREATED_AT))
  local remove = false
  if state and TERMINAL[state] then
    local at = tonumber(updated or created or '')
    if at and at <= tonumber(cutoff) then
      redis.call('DEL', key)
      remove = true
    end
  elseif not state then
    remove = redis.call('EXISTS', key) == 0  -- deleted by hand: a dangling index entry
  end
  if remove then
    redis.call('ZREM', index, ids[i])
    gone[#gone + 1] = 1
  else
    gone[#gone + 1] = 0
  end
end
return gone
