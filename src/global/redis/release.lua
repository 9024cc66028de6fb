-- Takes back ARGV[7] unused tokens, never past capacity, unless they expired at ARGV[8] (Unix
-- us by Redis's clock, 0: never): a calendar quota's tokens that arrive at or after their
-- window's reset would add to the next window. Returns the tokens now held.
if in_time(tonumber(ARGV[8])) then
  tokens = math_min(tokens + math_min(tonumber(ARGV[7]), capacity), capacity)
  if tokens == capacity then
    remainder = 0
  end
  store()
end
return math_max(tokens, 0)
