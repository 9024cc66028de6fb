-- Dispenses between ARGV[4] (min) and ARGV[5] (want) tokens that are there, and reserves,
-- up to want in all, those due within ARGV[6] microseconds of the tokens already owed (when
-- fewer than min are there, at least min of them); see TokenBucket::take_or_reserve.
-- Returns { granted, reserved, microseconds until the reserved are due, remaining,
--           microseconds until min tokens are there again }.
local min = math.min(math.max(tonumber(ARGV[4]), 1), capacity)
local want = math.min(math.max(tonumber(ARGV[5]), min), capacity)
local granted = 0
if tokens >= min then
  granted = math.min(want, tokens)
end
-- Reservations queue: each reaches at most max_delay beyond the tokens already owed.
local due = math.min(want, math.max(level_after(micros_until(0) + tonumber(ARGV[6])), 0))
local extra = math.max(due - granted, 0)
local reserved, ready_in = 0, 0
if extra > 0 and (granted > 0 or extra >= min) then
  reserved, ready_in = extra, micros_until(granted + extra)
end
tokens = tokens - granted - reserved
store()
-- Waits are capped at bucket::MAX_WAIT_MICROS.
return { granted, reserved, math.min(ready_in, 2 ^ 53), math.max(tokens, 0),
  math.min(micros_until(min), 2 ^ 53) }
