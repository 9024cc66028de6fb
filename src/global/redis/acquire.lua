-- Dispenses between ARGV[7] (min) and ARGV[8] (want) tokens that are there, and reserves,
-- up to want in all, those due within ARGV[9] microseconds of the tokens already owed (when
-- fewer than min are there, at least min of them); see TokenBucket::take_or_reserve (and its
-- take_warming with a warm-up).
-- Returns { granted, reserved, microseconds until the reserved are due, remaining,
--           microseconds until min tokens are there again }.
local min = math_min(math_max(tonumber(ARGV[7]), 1), capacity)
local want = math_min(math_max(tonumber(ARGV[8]), min), capacity)
local warming = cold_max > 0
local granted = 0
local there = tokens
if warming then
  there = permits_within(units(), min, want)
end
if there >= min then
  granted = math_min(want, there)
end
-- Reservations queue: each reaches at most max_delay beyond the tokens already owed; a
-- max_delay of zero reserves nothing, even behind a debt.
local max_delay = tonumber(ARGV[9])
local horizon = micros_until(0) + max_delay
local due
if max_delay == 0 then
  due = 0
elseif warming then
  -- Reserved permits are paid one after another, so their level is not capped at capacity;
  -- beyond (3 * capacity + 1) tokens every want is covered, so the sum stops there, exact.
  local most = (3 * capacity + 1) * p
  local later = most
  local to_most, short = divmod(most - units(), a)
  if short > 0 then
    to_most = to_most + 1
  end
  if horizon < to_most then
    later = units() + horizon * a
  end
  due = permits_within(later, min, want)
else
  due = math_min(want, math_max(level_after(horizon), 0))
end
local extra = math_max(due - granted, 0)
local reserved, ready_in = 0, 0
if extra > 0 and (granted > 0 or extra >= min) then
  reserved = extra
  if warming then
    ready_in = micros_until_units(required(granted + extra, min))
  else
    ready_in = micros_until(granted + extra)
  end
end
local refill_in
if warming then
  consume(granted + reserved)
  refill_in = micros_until_units(required(min, min))
else
  tokens = tokens - granted - reserved
  refill_in = micros_until(min)
end
store()
-- Waits are capped at bucket::MAX_WAIT_MICROS.
return { granted, reserved, math_min(ready_in, 2 ^ 53), math_max(tokens, 0),
  math_min(refill_in, 2 ^ 53) }
