-- Dispenses between ARGV[4] (min) and ARGV[5] (want) tokens, or none.
-- Returns { granted, remaining, microseconds until min tokens are there again }.
local min = math.max(tonumber(ARGV[4]), 1)
local want = math.max(tonumber(ARGV[5]), min)
local granted = 0
if tokens >= min then
  granted = math.min(want, tokens)
end
tokens = tokens - granted
store()
return { granted, tokens, math.min(micros_until(min), 2 ^ 53) } -- bucket::MAX_WAIT_MICROS
