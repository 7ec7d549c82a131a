-- Shared helpers, prepended to every script (after the LIMITS of spopp.api.tracker_api, which the
-- store writes as `local NAME = value` lines). ARGV[1] is the run's key prefix "spopp:{run}:";
-- the braces are a hash tag, so a run's keys live on one shard.
-- Floats cross the Lua boundary as strings formatted with 17 digits: Redis would truncate a Lua
-- number to an integer in a reply, and to 14 digits in a command argument.
--
-- Redis does not roll a script back when it fails half-way: what it wrote before the error
-- stays. So every script checks all its arguments (and the state it reads) before its first
-- write, and its arithmetic only ever sees bounded numbers: a refused call changes nothing.
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

-- The number that `s` spells when it lies in [lo, hi] (so never nan nor inf), else nil.
local function within(s, lo, hi)
  local x = tonumber(s)
  if x == nil or x ~= x or x < lo or x > hi then return nil end
  return x
end

-- Likewise for a whole number.
local function whole(s, lo, hi)
  local x = within(s, lo, hi)
  if x == nil or x ~= math.floor(x) then return nil end
  return x
end

-- A number in (0, hi].
local function positive(s, hi)
  local x = within(s, 0, hi)
  if x == nil or x <= 0 then return nil end
  return x
end

-- The refusal of an argument out of bounds; the API's validation catches these first, so this
-- only answers a caller that went around it.
local function invalid(what, value)
  return fail(422, 'invalid', what .. ' is missing or out of bounds', { value = tostring(value) })
end

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
  return req ~= nil and req.state == 'leased' and tonumber(req.exp) > now
end

local function load_req(rid)
  local raw = redis.call('HGETALL', req_key(rid))
  if #raw == 0 then return nil end
  local r = {}
  for i = 1, #raw, 2 do r[raw[i]] = raw[i + 1] end
  return r
end

-- A request leaves the lease table for good (reported, released or expired). Its record is kept
-- for ttl_ms more, so that a retried report or release answers as the first did and a late
-- report is refused with 409; after that it is forgotten (404), and the keys a run holds stay
-- O(tasks + finished requests of the last ttl), not O(every dispatch ever made). A live lease
-- has no expiry: at most one per task, and it may be renewed for as long as its episode runs.
local function finish(rid, state, ttl_ms)
  local rk = req_key(rid)
  redis.call('HSET', rk, 'state', state)
  redis.call('PEXPIRE', rk, ttl_ms)
  redis.call('ZREM', LEASES, rid)
end

-- A lease past its expiry that nobody has reclaimed yet: its task returns to the pool.
local function expire(rid, req, clock, floor, ttl_ms)
  finish(rid, 'expired', ttl_ms)
  make_idle(req.task, tonumber(req.E), clock, floor)
  redis.call('HINCRBY', RUN, 'expirations', 1)
end

-- The sampler's draw stream: the caller computed its Exp(1) draws for counters start, start+1, ...
-- of (seed, stream key) from a hint it holds. If the hint is stale (another process used the stream, or
-- the run is not what the caller thinks), answer the true position so the caller can redo its
-- draws; the counter only ever advances by the draws a successful call used, so a refused call
-- leaves the stream, like everything else, unchanged.
-- The stream's key (the run's study, or its name) never changes, so it travels in the hint only.
local function stale_stream(start, seed, mass)
  local f = redis.call('HMGET', RUN, 'draws', 'seed', 'prior_mass', 'stream')
  if f[1] == start and f[2] == seed and f[3] == mass then return nil end
  return cjson.encode({ stream = { start = f[1], seed = f[2], prior_mass = f[3], key = f[4] or '' } })
end

-- Exp(1) draws ARGV[first .. first + n - 1]: -log(u) for u in (0, 1) made from 53 bits lies in
-- (0, 38), so anything else is a caller's bug.
local function bad_draws(first, n)
  for i = first, first + n - 1 do
    if not positive(ARGV[i], 64) then return invalid('draw ' .. (i - first + 1), ARGV[i]) end
  end
  return nil
end

local function need_run()
  if redis.call('EXISTS', RUN) == 0 then
    return fail(404, 'unknown_run', 'no such run')
  end
  return nil
end

-- The run's name, from its key prefix "spopp:{run}:", for messages.
local function run_name() return string.sub(P, 8, -3) end

-- A finished run takes no new leases and no new policy versions; `what` says which was refused.
local function refuse_if_finished(what)
  if redis.call('HGET', RUN, 'status') ~= 'finished' then return nil end
  local final = redis.call('HGET', RUN, 'final_version')
  return fail(409, 'run_finished', 'run ' .. run_name() .. ' finished at version ' .. final .. ': ' .. what,
    { policy_version = tonumber(final) })
end

-- Per-worker stats: one hash per statistic, keyed by worker id, so a run's workers cost five
-- keys however many there are. W_SEEN (worker -> last seen, ms of Redis TIME) lists the known
-- workers; their number is bounded by the caller's cap, so no caller can grow Redis without end.
local W_LEASES = P .. 'wk:leases'
local W_OUTCOMES = P .. 'wk:outcomes'
local W_TRAJ = P .. 'wk:traj'
local W_EPS = P .. 'wk:eps'
local W_SEEN = P .. 'wk:seen'

-- Nil when `worker` may keep stats (known already, or room for one more under `cap`).
local function refuse_new_worker(worker, cap)
  if redis.call('HEXISTS', W_SEEN, worker) == 1 then return nil end
  local n = redis.call('HLEN', W_SEEN)
  if n < cap then return nil end
  return fail(409, 'too_many_workers', 'run ' .. run_name() .. ' keeps stats of at most ' .. cap ..
    ' workers and has ' .. n .. ': reuse worker ids', { max_workers = cap })
end

-- The worker was seen now; every statistic gets a field, so a reader sees zeros, not holes.
local function worker_seen(worker, now)
  redis.call('HSET', W_SEEN, worker, now)
  for _, key in ipairs({ W_LEASES, W_OUTCOMES, W_TRAJ, W_EPS }) do redis.call('HSETNX', key, worker, 0) end
end
