-- Takes back ARGV[4] unused tokens, never past capacity. Returns the tokens now held.
tokens = math.min(tokens + math.min(tonumber(ARGV[4]), capacity), capacity)
if tokens == capacity then
  remainder = 0
end
store()
return math.max(tokens, 0)
