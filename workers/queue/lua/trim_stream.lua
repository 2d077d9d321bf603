-- Trim a stage stream to the lowest entry any group still needs, and forget consumers idle
-- past idle_ms with nothing pending. One script, so no group can read or claim between finding
-- the floor and trimming to it. The floor is a group's oldest pending entry or, with nothing
-- pending, the entry after its last-delivered id (everything after that is unread). Exact MINID
-- drops whole nodes (up to 100 entries each) and walks only the node at the floor, so a call
-- costs about one step per hundred entries acknowledged since the previous sweep. Entries
-- added since kept_since_ms (unix ms) stay, acknowledged or not, for inspecting recent traffic.
-- KEYS: stream
-- ARGV: idle_ms, kept_since_ms
-- Returns {entries trimmed, consumers forgotten}.
if redis.call('EXISTS', stream) == 0 then return {0, 0} end
local floor_ms, floor_seq
local forgotten = 0
local groups = redis.call('XINFO', 'GROUPS', stream)
if #groups == 0 then return {0, 0} end  -- no reader yet: every entry is unread
for _, raw in ipairs(groups) do
  local g = {}
  for i = 1, #raw, 2 do g[raw[i]] = raw[i + 1] end
  local ms, seq
  if tonumber(g['pending']) > 0 then
    local oldest = redis.call('XPENDING', stream, g['name'])[2]
    ms, seq = string.match(oldest, '^(%d+)-(%d+)$')
    ms, seq = tonumber(ms), tonumber(seq)
  else
    ms, seq = string.match(g['last-delivered-id'], '^(%d+)-(%d+)$')
    -- Sequence numbers count entries added within one millisecond: far below 2^53.
    ms, seq = tonumber(ms), tonumber(seq) + 1
  end
  if not floor_ms or ms < floor_ms or (ms == floor_ms and seq < floor_seq) then
    floor_ms, floor_seq = ms, seq
  end
  for _, rawc in ipairs(redis.call('XINFO', 'CONSUMERS', stream, g['name'])) do
    local c = {}
    for i = 1, #rawc, 2 do c[rawc[i]] = rawc[i + 1] end
    if tonumber(c['pending']) == 0 and tonumber(c['idle']) > tonumber(idle_ms) then
      redis.call('XGROUP', 'DELCONSUMER', stream, g['name'], c['name'])
      forgotten = forgotten + 1
    end
  end
end
local kept_since = tonumber(kept_since_ms)
if kept_since <= floor_ms then floor_ms, floor_seq = kept_since, 0 end
local floor = string.format('%.0f-%.0f', floor_ms, floor_seq)
return {redis.call('XTRIM', stream, 'MINID', floor), forgotten}
