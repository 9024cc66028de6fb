-- Takes back ARGV[7] unused tokens, never past capacity. Returns the tokens now held.
tokens = math.min(tokens + math.min(tonumber(ARGV[7]), capacity), capacity)
if tokens == capacity then
  remainder = 0
end
store()
return math.max(tokens, 0)
