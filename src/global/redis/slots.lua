-- Sets what one host holds of a key's concurrency slots (see SlotStore and Holding::granted).
-- KEYS[1]: a hash of host -> "held seq expires_at" (Redis microseconds).
-- ARGV[1] max, ARGV[2] host, ARGV[3] seq, ARGV[4] want, ARGV[5] ttl in us,
-- ARGV[6]: now in us (tests only; else TIME).
-- Returns { held, what the other hosts hold }.
local key = KEYS[1]
local max = tonumber(ARGV[1])
local host = ARGV[2]
local seq = tonumber(ARGV[3])
local want = tonumber(ARGV[4])
local ttl = tonumber(ARGV[5])
local now
if ARGV[6] ~= nil then
  now = tonumber(ARGV[6])
else
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end
local entries = redis.call('HGETALL', key)
local others, last = 0, now
local mine_held, mine_seq
for i = 1, #entries, 2 do
  local held, s, expires = string.match(entries[i + 1], '^(%d+) (%d+) (%d+)$')
  held, s, expires = tonumber(held), tonumber(s), tonumber(expires)
  if expires == nil or expires <= now then
    redis.call('HDEL', key, entries[i])
  else
    if entries[i] == host then
      mine_held, mine_seq = held, s
    else
      others = others + held
    end
    last = math.max(last, expires)
  end
end
-- Seq and expiry are microseconds since 1970: '%d' holds them only where Lua's '%d' has 64
-- bits (not on a 32-bit build of Redis); '%.0f' is exact everywhere.
local INTEGER = string.format('%d', 2 ^ 40) == '1099511627776' and '%d' or '%.0f'
-- A call older than the one applied changes nothing.
if mine_seq ~= nil and seq <= mine_seq then
  return { mine_held, others }
end
-- Never less than the host holds, up to want: a call takes only what it gives back.
local held = math.min(want, math.max(mine_held or 0, max - others, 0))
local expires = now + ttl
-- Kept even when empty, for its seq: a late call must not apply after it.
local holding = string.format(INTEGER .. ' ' .. INTEGER .. ' ' .. INTEGER, held, seq, expires)
redis.call('HSET', key, host, holding)
last = math.max(last, expires)
redis.call('PEXPIRE', key, math.ceil((last - now) / 1000))
return { held, others }
