-- Read up to ``count`` new entries of the first of ``streams`` that has any, and claim each
-- entry's request for this first delivery in the same call: a busy worker's read and its fences
-- cost one round trip, where a read, then the claims, cost two or three. Non-blocking: when
-- every stream is empty the caller blocks on XREADGROUP and claims what that brings.
-- KEYS: streams (in the order the worker takes work)
-- ARGV: group, consumer, count, stage, running (the state a claim moves into), now, fields
--       (what a claim writes, as JSON)
-- Returns {} when every stream is empty, else {stream, {entry_id, job, claim}, ...}, where a
-- claim is what claim.lua answers, or 0 for a job this script cannot read (the caller drops
-- it, unclaimed). An entry's header (``add_job``) names its record; an entry without one is
-- read as JSON, its record key built as keys/names.py builds it (RECORD_KEY).
local write = cjson.decode(fields)
for _, stream in ipairs(streams) do
  local got = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
                         'STREAMS', stream, '>')
  if got then
    local answer = {stream}
    for _, entry in ipairs(got[1][2]) do
      local f = {}
      for i = 1, #entry[2], 2 do f[entry[2][i]] = entry[2][i + 1] end
      local raw = f.job or ''
      local version, record, generation = tonumber(f.v), f.record, tonumber(f.gen)
      if not record then  -- an entry without the header (``add_job``): read the job itself
        local ok, job = pcall(cjson.decode, raw)
        if ok and type(job) == 'table' and type(job.tenant) == 'string'
            and type(job.request_id) == 'string' then
          version, record = job.v, RECORD_KEY(job.tenant, job.request_id)
          generation = tonumber(job.generation) or 0
        end
      end
      local claim = 0
      if record and version == MESSAGE_VERSION and generation then
        -- A first delivery: attempt 1 of the job's generation.
        local token = string.format('%.0f', generation * ATTEMPTS_PER_GENERATION + 1)
        claim = claim_stage(record, stage, token, generation, running, now, write)
      end
      answer[#answer + 1] = {entry[1], raw, claim}
    end
    return answer
  end
end
return {}
