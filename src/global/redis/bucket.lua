-- The lazy token bucket of src/bucket.rs, step for step, in integers that stay below 2^53
-- (Limit validates p * (a + 2) < 2^53 and capacity < 2^53; with a warm-up, also cold_max <
-- 2^52 and (3 * capacity + 1) * p < 2^53), so Lua's doubles are exact.
-- KEYS[1]: the bucket, one string of integers "t r u" or, with a warm-up, "t r u c": t whole
-- tokens (negative while reserved tokens are owed), r the remainder in 1/p tokens, u the time
-- updated (us), c cold permits in 1/p tokens. One string, so a bucket costs Redis one GET to
-- read and one SET (with its expiry) to write.
-- ARGV[1] capacity, ARGV[2] a, ARGV[3] p (a tokens per p microseconds, lowest terms),
-- ARGV[4] the most cold permits (0: no warm-up), ARGV[5] a calendar quota's period (0: none,
-- 1 day, 2 week, 3 month; its capacity comes back at each reset, a and p unused), ARGV[6] its
-- resets' distance from midnight UTC in us; in a zone whose offset changes, `before,change,after`:
-- that distance before the change nearest to the call, the change (Unix us), and after it.
-- ARGV[7] to ARGV[9]: the operation's arguments, ARGV[10]: now in us (tests only; else TIME).
-- An operation's script follows this one and starts with `load(KEYS, ARGV)`.

-- One bucket's state, set by `load` for each bucket a script serves: a script over many
-- buckets defines the functions below once.
local capacity, a, p, cold_max, period
local shift_before, change, shift_after, zoned
local simulated, now, key
local tokens, remainder, updated, cold, as_of

-- The library's functions as locals: each use then skips two table lookups (`math`, then its
-- field).
local math_min, math_max, math_floor, math_ceil = math.min, math.max, math.floor, math.ceil

-- How integers are written: '%d' skips the C library's floating-point formatting of '%.0f',
-- but is exact only where Lua's '%d' has 64 bits (not on a 32-bit build of Redis).
local INTEGER = string.format('%d', 2 ^ 40) == '1099511627776' and '%d' or '%.0f'
-- A bucket's whole tokens, remainder and time updated, as stored.
local STATE = INTEGER .. ' ' .. INTEGER .. ' ' .. INTEGER

-- Floor division and remainder, exact for integers below 2^53 (one correction step).
local function divmod(x, d)
  local q = math_floor(x / d)
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

-- A calendar quota's windows (src/calendar.rs): days since 1970-01-01 of a civil date, the
-- civil year and month of such a day, the window holding a time, and the start of a window.
local DAY = 86400000000

local function days_from_civil(y, m, d)
  if m <= 2 then
    y = y - 1
  end
  local era = math_floor(y / 400)
  local yoe = y - era * 400
  local doy = math_floor((153 * ((m + 9) % 12) + 2) / 5) + d - 1
  return era * 146097 + yoe * 365 + math_floor(yoe / 4) - math_floor(yoe / 100) + doy - 719468
end

local function civil_from_days(z)
  z = z + 719468
  local era = math_floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math_floor((doe - math_floor(doe / 1460) + math_floor(doe / 36524)
    - math_floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math_floor(yoe / 4) - math_floor(yoe / 100))
  local mp = math_floor((5 * doy + 2) / 153)
  local m = mp + 3
  if mp >= 10 then
    m = mp - 9
  end
  local y = yoe + era * 400
  if m <= 2 then
    y = y + 1
  end
  return y, m
end

local function start(k)
  local days
  if period == 1 then
    days = k
  elseif period == 2 then
    days = k * 7 + 4
  else
    local y = math_floor(k / 12)
    days = days_from_civil(y, k - y * 12 + 1, 1)
  end
  -- A local time the clocks repeat names its first instant; one they skip, the instant the
  -- gap's length after it (Offsets::instant_of in src/calendar/zone.rs).
  local early = days * DAY + shift_before
  if early < change then
    return math_max(early, 0)
  end
  local late = days * DAY + shift_after
  if late >= change then
    return math_max(late, 0)
  end
  return math_max(early, 0)
end

local function window(t)
  local shift = shift_before
  if t >= change then
    shift = shift_after
  end
  local days = divmod(t - shift, DAY)
  local k
  if period == 1 then
    k = days
  elseif period == 2 then
    k = math_floor((days - 4) / 7)
  else
    local y, m = civil_from_days(days)
    k = y * 12 + m - 1
  end
  if zoned then
    -- A reset in an hour the clocks repeat or skip puts the local date one window off.
    if start(k + 1) <= t then
      return k + 1
    elseif start(k) > t then
      return k - 1
    end
  end
  return k
end

-- The level `elapsed` microseconds after (tokens, remainder): a per p microseconds (a calendar
-- quota: its capacity at each reset), never past capacity.
local function level_after(elapsed)
  if tokens >= capacity then
    return capacity, 0
  end
  if period > 0 then
    local resets = window(as_of + elapsed) - window(as_of)
    return math_min(tokens + resets * capacity, capacity), 0
  end
  local q, r = divmod(elapsed, p)
  local whole, rest = divmod(remainder + r * a, p)
  local added = q * a + whole
  if added >= capacity - tokens then
    return capacity, 0
  end
  return tokens + added, rest
end

-- Microseconds until the bucket holds n tokens (n <= capacity), rounded up:
-- ceil(((n - tokens) * p - remainder) / a), split so every product stays exact.
local function micros_until(n)
  if tokens >= n then
    return 0
  end
  if period > 0 then
    local resets = math_ceil((n - tokens) / capacity)
    return start(window(as_of) + resets) - as_of
  end
  local qa, ra = divmod(n - tokens, a)
  local q, r = divmod(ra * p - remainder, a)
  if r > 0 then
    q = q + 1
  end
  return qa * p + q
end

-- The warm-up's pricing (TokenBucket::price and its helpers); used only when cold_max > 0,
-- where every level in 1/p tokens stays exact.
local function units()
  return tokens * p + remainder
end

local function surcharge(hi, lo)
  if 2 * hi <= cold_max then
    return 0
  end
  local low = math_max(2 * lo, cold_max)
  return math_ceil((2 * hi - low) * (2 * hi + low - 2 * cold_max) / (2 * cold_max))
end

local function price(permits)
  local unit = permits * p
  return unit + surcharge(cold, cold - math_min(unit, cold))
end

local function permits_within(u, min, want)
  if u < p then
    return 0
  end
  local lo, hi = 0, want - 1
  while lo < hi do
    local mid = lo + math_ceil((hi - lo) / 2)
    if price(mid) <= u - p then
      lo = mid
    else
      hi = mid - 1
    end
  end
  if u >= capacity * p then
    return math_max(lo + 1, min)
  end
  return lo + 1
end

local function required(permits, min)
  local paid = p + price(permits - 1)
  if permits <= min then
    return math_min(paid, capacity * p)
  end
  return paid
end

local function micros_until_units(target)
  local needed = target - units()
  if needed <= 0 then
    return 0
  end
  local q, r = divmod(needed, a)
  if r > 0 then
    q = q + 1
  end
  return q
end

local function consume(permits)
  local u = units() - price(permits)
  cold = cold - math_min(permits * p, cold)
  tokens, remainder = divmod(u, p)
end

-- Whether a call that expires at `expires` (Unix us by this script's time; 0: never) still
-- counts: see bucket::has_expired.
local function in_time(expires)
  return expires == 0 or now < expires
end

-- Stores the bucket, expiring it when it would be full (and fully cold) again; a full bucket
-- is deleted, as a missing bucket starts full.
local function store()
  local to_full = micros_until(capacity)
  if cold_max > 0 then
    local q, r = divmod(cold_max - cold, a)
    if r > 0 then
      q = q + 1
    end
    to_full = to_full + q
  end
  if to_full == 0 then
    redis.call('DEL', key)
    return
  end
  local value = string.format(STATE, tokens, remainder, now)
  if cold_max > 0 then
    -- Rounded: the cold permits' bound may be reached by a product that rounds.
    value = value .. string.format(' %.0f', cold)
  end
  if simulated then
    redis.call('SET', key, value)
  else
    local ms = math_min(math_ceil(to_full / 1000), 2 ^ 52)
    redis.call('SET', key, value, 'PX', string.format(INTEGER, ms))
  end
end

-- The limit's six arguments as last read: a script over many buckets of one limit reads them
-- once (Lua's strings are interned, so comparing them is comparing references).
local read_1, read_2, read_3, read_4, read_5, read_6

-- Reads the limit of ARGV[1] to ARGV[6], unless it is the one read last.
local function read_limit(ARGV)
  if ARGV[1] == read_1 and ARGV[2] == read_2 and ARGV[3] == read_3 and ARGV[4] == read_4
      and ARGV[5] == read_5 and ARGV[6] == read_6 then
    return
  end
  read_1, read_2, read_3, read_4, read_5, read_6 = ARGV[1], ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6]
  capacity = tonumber(ARGV[1])
  a = tonumber(ARGV[2])
  p = tonumber(ARGV[3])
  cold_max = tonumber(ARGV[4])
  period = tonumber(ARGV[5])
  zoned = string.find(ARGV[6], ',', 1, true) ~= nil
  if zoned then
    shift_before, change, shift_after = string.match(ARGV[6], '^(-?%d+),(-?%d+),(-?%d+)$')
    shift_before, change, shift_after = tonumber(shift_before), tonumber(change), tonumber(shift_after)
  else
    shift_before = tonumber(ARGV[6])
    shift_after = shift_before
    change = 0
  end
end

-- Reads bucket KEYS[1] under the limit of ARGV[1] to ARGV[6] at ARGV[10] (tests only), else at
-- `redis_now` (Redis's time, read once by a script over many buckets), else at Redis's time
-- read now; refills it to that time.
local function load(KEYS, ARGV, redis_now)
  read_limit(ARGV)

  -- A caller-supplied time (tests only) is simulated: Redis's real-time expiry would cut it short.
  simulated = ARGV[10] ~= nil
  if simulated then
    now = tonumber(ARGV[10])
  elseif redis_now then
    now = redis_now
  else
    -- Redis's clock, never the hosts': theirs drift.
    local time = redis.call('TIME')
    now = tonumber(time[1]) * 1000000 + tonumber(time[2])
  end

  key = KEYS[1]
  local value = redis.call('GET', key)
  tokens, remainder, updated, cold = capacity, 0, now, cold_max
  if value then
    local t, r, u, c = string.match(value, '^(%-?%d+) (%d+) (%d+) ?(%d*)$')
    if not t then
      -- Something else wrote under the prefix: fail before writing anything.
      error('not a bucket: ' .. key)
    end
    tokens = tonumber(t)
    -- A remainder kept under another limit (the key's limit changed; its p is not stored)
    -- counts for less than one token of this one.
    remainder = math_min(tonumber(r), math_max(p - 1, 0))
    updated = tonumber(u)
    -- Cold permits of another limit (one the key moved from) count up to this one's store.
    cold = math_min(tonumber(c) or 0, cold_max)
    -- A clock that stepped back (a failover) must not count the same time twice.
    now = math_max(now, updated)
  end
  -- The time (tokens, remainder) are as of: the last update's, then now's once refilled.
  as_of = updated
  -- Time spent full stores cold permits (warm-up only), at the refill rate, for at most the
  -- warm-up period (cold_max / a microseconds).
  if cold_max > 0 then
    local idle_full = math_min(math_max(now - updated - micros_until(capacity), 0), cold_max / a)
    cold = math_min(cold + idle_full * a, cold_max)
  end
  tokens, remainder = level_after(now - updated)
  as_of = now
end
