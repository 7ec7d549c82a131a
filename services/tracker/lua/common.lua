-- Shared helpers, prepended to every script. ARGV[1] is the run's key prefix "spopp:{run}:";
-- the braces are a hash tag, so a run's keys live on one shard.
-- Floats cross the Lua boundary as strings formatted with 17 digits: Redis would truncate a Lua
-- number to an integer in a reply, and to 14 digits in a command argument.
local P = ARGV[1]
local RUN = P .. 'run'
local IDLE = P .. 'idle'
local LEASES = P .. 'leases'
local TASKS = P .. 'tasks'

local function fmt(x) return string.format('%.17g', x) end

local function fail(status, code, message, ctx)
  local d = ctx or {}
  d.code = code
  d.message = message
  return cjson.encode({ error = { status = status, detail = d } })
end

local function ok(body) return cjson.encode({ ok = body }) end

-- Redis's own clock, so that every tracker process judges leases alike.
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end

local function hnum(key, field)
  return tonumber(redis.call('HGET', key, field))
end

local function weight(a, b, floor)
  local v = a / (a + b)
  return math.sqrt(v * (1 - v)) + floor
end

local function task_key(tid) return P .. 't:' .. tid end
local function req_key(rid) return P .. 'r:' .. rid end

-- Put a task back in the race with the Exp(1) draw E reserved for it at dispatch.
local function make_idle(tid, E, clock, floor)
  local tk = task_key(tid)
  redis.call('HDEL', tk, 'req')
  local w = weight(hnum(tk, 'a'), hnum(tk, 'b'), floor)
  redis.call('ZADD', IDLE, fmt(clock + E / w), tid)
end

local function live(req, now)
  return req.state == 'leased' and tonumber(req.exp) > now
end

local function load_req(rid)
  local raw = redis.call('HGETALL', req_key(rid))
  if #raw == 0 then return nil end
  local r = {}
  for i = 1, #raw, 2 do r[raw[i]] = raw[i + 1] end
  return r
end

-- A lease past its expiry that nobody has reclaimed yet: its task returns to the pool.
local function expire(rid, req, clock, floor)
  redis.call('HSET', req_key(rid), 'state', 'expired')
  redis.call('ZREM', LEASES, rid)
  make_idle(req.task, tonumber(req.E), clock, floor)
  redis.call('HINCRBY', RUN, 'expirations', 1)
end

-- The sampler's draw stream: the caller computed its Exp(1) draws for counters start, start+1, ...
-- of (seed, run) from a hint it holds. If the hint is stale (another process used the stream, or
-- the run is not what the caller thinks), answer the true position so the caller can redo its
-- draws; the counter only ever advances by the draws a successful call used, so a refused call
-- leaves the stream, like everything else, unchanged.
local function stale_stream(start, seed, mass)
  local f = redis.call('HMGET', RUN, 'draws', 'seed', 'prior_mass')
  if f[1] == start and f[2] == seed and f[3] == mass then return nil end
  return cjson.encode({ stream = { start = f[1], seed = f[2], prior_mass = f[3] } })
end

local function need_run()
  if redis.call('EXISTS', RUN) == 0 then
    return fail(404, 'unknown_run', 'no such run')
  end
  return nil
end
