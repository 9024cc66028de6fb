-- The lazy token bucket of src/bucket.rs, step for step, in integers that stay below 2^53
-- (Limit validates p * (a + 2) < 2^53 and capacity < 2^53), so Lua's doubles are exact.
-- KEYS[1]: the bucket (a hash: t = whole tokens, negative while reserved tokens are owed,
-- r = remainder in 1/p tokens, u = updated us).
-- ARGV[1] capacity, ARGV[2] a, ARGV[3] p (a tokens per p microseconds, lowest terms),
-- ARGV[4] to ARGV[6]: the operation's arguments, ARGV[7]: now in us (tests only; else TIME).

local capacity = tonumber(ARGV[1])
local a = tonumber(ARGV[2])
local p = tonumber(ARGV[3])

-- Floor division and remainder, exact for integers below 2^53 (one correction step).
local function divmod(x, d)
  local q = math.floor(x / d)
  local r = x - q * d
  if r < 0 then
    q = q - 1
    r = r + d
  elseif r >= d then
    q = q + 1
    r = r - d
  end
  return q, r
end

-- A caller-supplied time (tests only) is simulated: Redis's real-time expiry would cut it short.
local simulated = ARGV[7] ~= nil
local now
if simulated then
  now = tonumber(ARGV[7])
else
  -- Redis's clock, never the hosts': theirs drift.
  local time = redis.call('TIME')
  now = tonumber(time[1]) * 1000000 + tonumber(time[2])
end

local state = redis.call('HMGET', KEYS[1], 't', 'r', 'u')
local tokens, remainder, updated = capacity, 0, now
if state[1] then
  tokens = tonumber(state[1])
  remainder = tonumber(state[2])
  updated = tonumber(state[3])
  -- A clock that stepped back (a failover) must not count the same time twice.
  now = math.max(now, updated)
end

-- The level `elapsed` microseconds after (tokens, remainder): a per p microseconds, never
-- past capacity.
local function level_after(elapsed)
  if tokens >= capacity then
    return capacity, 0
  end
  local q, r = divmod(elapsed, p)
  local whole, rest = divmod(remainder + r * a, p)
  local added = q * a + whole
  if added >= capacity - tokens then
    return capacity, 0
  end
  return tokens + added, rest
end

tokens, remainder = level_after(now - updated)

-- Microseconds until the bucket holds n tokens (n <= capacity), rounded up:
-- ceil(((n - tokens) * p - remainder) / a), split so every product stays exact.
local function micros_until(n)
  if tokens >= n then
    return 0
  end
  local qa, ra = divmod(n - tokens, a)
  local q, r = divmod(ra * p - remainder, a)
  if r > 0 then
    q = q + 1
  end
  return qa * p + q
end

-- Stores the bucket, expiring it when it would be full again; a full bucket is deleted, as a
-- missing bucket starts full.
local function store()
  local to_full = micros_until(capacity)
  if to_full == 0 then
    redis.call('DEL', KEYS[1])
    return
  end
  local ms = math.min(math.ceil(to_full / 1000), 2 ^ 52)
  redis.call('HSET', KEYS[1], 't', string.format('%.0f', tokens), 'r', string.format('%.0f', remainder),
    'u', string.format('%.0f', now))
  if not simulated then
    redis.call('PEXPIRE', KEYS[1], string.format('%.0f', ms))
  end
end
