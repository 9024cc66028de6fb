-- Applies an operator's adjustment (ARGV[7]: 0 reset, 1 drain, 2 add, 3 remove) of ARGV[8]
-- tokens (add and remove), unless it expired at ARGV[9] (Unix us by Redis's clock, 0: never);
-- see TokenBucket::adjust. Returns the level after, as level.lua does, then 1 if the change
-- was applied, 0 if it had expired.
local op = tonumber(ARGV[7])
local n = tonumber(ARGV[8])
local applied = in_time(tonumber(ARGV[9]))
if applied then
  if op == 0 then
    tokens, remainder, cold = capacity, 0, cold_max
  elseif op == 1 then
    tokens, remainder = math_min(tokens, 0), 0
  elseif op == 2 then
    tokens = math_min(tokens + n, capacity)
  else
    -- Into debt of at most a capacity.
    tokens = math_min(tokens, math_max(tokens - n, -capacity))
  end
  if tokens == capacity then
    remainder = 0
  end
  store()
end
local whole = math_max(tokens, 0)
return { whole, math_min(micros_until(math_min(whole + 1, capacity)), 2 ^ 53),
  math_min(micros_until(capacity), 2 ^ 53), applied and 1 or 0 }
