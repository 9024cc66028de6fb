-- Reads the bucket without changing it. Returns { tokens, microseconds until one more,
-- microseconds until full }.
local whole = math_max(tokens, 0)
return { whole, math_min(micros_until(math_min(whole + 1, capacity)), 2 ^ 53),
  math_min(micros_until(capacity), 2 ^ 53) }
