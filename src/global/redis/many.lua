-- Many buckets of one node in one script. KEYS[i] is a bucket; ARGV holds five values per
-- bucket: the operation ('a' to acquire, 'r' to release), the number of its limit, and that
-- operation's ARGV[7] to ARGV[9]; then the number of limits, and each limit's six values (the
-- operation's ARGV[1] to ARGV[6]), once however many buckets share it; in tests, one more
-- closes ARGV: the simulated time. Returns the buckets' replies in order, as one list of
-- numbers: an acquire's five, a release's one (one list, so the reply is one array for the
-- client to read, not one per bucket). A bucket that fails (its key holds another type of
-- value, or a string that is no bucket's) fails alone: its numbers are -1 then zeros, and the
-- buckets after it go on. A write the server refuses (out of memory, a replica, a missing
-- permission) it refuses to every bucket: met before any bucket is answered, when nothing has
-- been written, it is the script's answer, in the server's words.
local per = 5
local limits_at = #KEYS * per + 1
local now = ARGV[limits_at + tonumber(ARGV[limits_at]) * 6 + 1]
-- Redis's time, once for every bucket of the script (none when the time is simulated).
local redis_now
if now == nil then
  local time = redis.call('TIME')
  redis_now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local replies = {}
local n = 0
local answered = false
-- The server's refusal of every write, if a bucket's failure `err` is one: not the bucket's
-- own (its key holds something else), and met before any bucket was answered.
local function refusal(err)
  local message = type(err) == 'table' and err.err or tostring(err)
  local own = string.find(message, 'WRONGTYPE', 1, true)
    or string.find(message, 'not a bucket', 1, true)
  if not own and not answered then
    return message
  end
end
-- One bucket's KEYS and ARGV, refilled for each bucket (the operations keep no reference to
-- them), rather than two tables made per bucket.
local keys, args = {}, {}
args[10] = now
for i = 1, #KEYS do
  local base = (i - 1) * per
  -- The same strings for every bucket of a limit, so `read_limit` reads each limit once.
  local limit_at = limits_at + (tonumber(ARGV[base + 2]) - 1) * 6
  for j = 1, 6 do
    args[j] = ARGV[limit_at + j]
  end
  for j = 7, 9 do
    args[j] = ARGV[base + j - 4]
  end
  keys[1] = KEYS[i]
  -- A bucket reads its key before it writes it: one that fails has written nothing.
  local acquiring = ARGV[base + 1] == 'a'
  local ok, reply = pcall(acquiring and acquire or release, keys, args, redis_now)
  local refused = not ok and refusal(reply)
  if refused then
    return redis.error_reply(refused)
  end
  answered = answered or ok
  if acquiring then
    for j = 1, 5 do
      replies[n + j] = ok and reply[j] or (j == 1 and -1 or 0)
    end
    n = n + 5
  else
    n = n + 1
    replies[n] = ok and reply or -1
  end
end
return replies
