-- Many calls of one script in one command: the calls a worker makes for a read of many jobs
-- (claims, publishes) cost one command's overhead, not one each. Each call runs as it would
-- alone, in order; the answers come back as a list, a failed call's error in its place.
-- Latency histograms are updated, and acknowledgements made, once at the end (``count_latency``,
-- ``ack``).
-- ARGV[1]: the script's name; ARGV[2]: JSON [[number of keys, number of args], ...], one
-- pair per call; then every call's args in turn. KEYS: every call's keys in turn.
local function batch(KEYS, ARGV)
  local script = SCRIPTS[ARGV[1]]
  local answers = {}
  local k, a = 1, 3
  defer()
  for i, shape in ipairs(cjson.decode(ARGV[2])) do
    -- One call's error is its own answer, as it was when each call was a command of its own:
    -- the calls after it still run, and the histograms still get what the others counted.
    local ok, answer = pcall(script, {unpack(KEYS, k, k + shape[1] - 1)},
                             {unpack(ARGV, a, a + shape[2] - 1)})
    if ok then
      answers[i] = answer
    else
      answers[i] = {err = type(answer) == 'table' and answer.err or tostring(answer)}
    end
    k, a = k + shape[1], a + shape[2]
  end
  apply_deferred()
  return answers
end
