-- Many buckets of one node in one script. KEYS[i] is a bucket; ARGV holds ten values per
-- bucket: the operation ('a' to acquire, 'r' to release), then that operation's ARGV[1] to
-- ARGV[9]; in tests, one more closes ARGV: the simulated time. Returns a reply per bucket, in
-- order: an acquire's five numbers, a release's one.
local per = 10
local now = ARGV[#KEYS * per + 1]
-- Redis's time, once for every bucket of the script (none when the time is simulated).
local redis_now
if now == nil then
  local time = redis.call('TIME')
  redis_now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local replies = {}
for i = 1, #KEYS do
  local base = (i - 1) * per
  local args = { ARGV[base + 2], ARGV[base + 3], ARGV[base + 4], ARGV[base + 5], ARGV[base + 6],
    ARGV[base + 7], ARGV[base + 8], ARGV[base + 9], ARGV[base + 10], now }
  if ARGV[base + 1] == 'a' then
    replies[i] = acquire({ KEYS[i] }, args, redis_now)
  else
    replies[i] = { release({ KEYS[i] }, args, redis_now) }
  end
end
return replies
