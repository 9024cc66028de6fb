-- wrk script: each request's x-api-key drawn from Zipf(s) over n keys ("key-1" the hottest).
-- Set ZIPF_KEYS and ZIPF_S in the environment (defaults: 100,000 and 1.0).
local n = tonumber(os.getenv("ZIPF_KEYS") or "100000")
local s = tonumber(os.getenv("ZIPF_S") or "1.0")
local cdf = {}

function init(args)
  local sum = 0
  for k = 1, n do
    sum = sum + 1 / k ^ s
    cdf[k] = sum
  end
  for k = 1, n do
    cdf[k] = cdf[k] / sum
  end
  math.randomseed(os.time())
end

function request()
  local u = math.random()
  local lo, hi = 1, n
  while lo < hi do
    local mid = math.floor((lo + hi) / 2)
    if cdf[mid] < u then lo = mid + 1 else hi = mid end
  end
  wrk.headers["x-api-key"] = "key-" .. lo
  return wrk.format(nil, "/")
end
