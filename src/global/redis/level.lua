-- Reads the bucket without changing it. Returns { tokens, microseconds until one more,
-- microseconds until full }.
local whole = math.max(tokens, 0)
return { whole, math.min(micros_until(math.min(whole + 1, capacity)), 2 ^ 53),
  math.min(micros_until(capacity), 2 ^ 53) }
