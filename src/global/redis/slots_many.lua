-- Many keys' slot holdings of one node in one script. KEYS[i] is a key's hash of holdings;
-- ARGV holds five values per key, slots.lua's ARGV[1] to ARGV[5]; in tests, one more closes
-- ARGV: the simulated time. Returns slots.lua's reply per key, in order, all at one time. A key
-- whose command fails (its hash holds another type of value) fails alone, having written
-- nothing (it reads first): its reply is { -1, 0 }, and the keys after it go on. A write the
-- server refuses (out of memory, a replica, a missing permission) it refuses to every key: met
-- before any key is answered, when nothing has been written, it is the script's answer, in
-- the server's words.
local per = 5
local now = ARGV[#KEYS * per + 1]
if now == nil then
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local replies = {}
local answered = false
for i = 1, #KEYS do
  local base = (i - 1) * per
  local ok, reply = pcall(hold, { KEYS[i] }, { ARGV[base + 1], ARGV[base + 2], ARGV[base + 3],
    ARGV[base + 4], ARGV[base + 5], now })
  if not ok and not answered then
    local message = type(reply) == 'table' and reply.err or tostring(reply)
    if not string.find(message, 'WRONGTYPE', 1, true) then
      return redis.error_reply(message)
    end
  end
  answered = answered or ok
  replies[i] = ok and reply or { -1, 0 }
end
return replies
