-- ARGV: prefix, update_id, then (task_id, reward, drift) in learner order. SPO only.
-- rho = clip(2^(-D/d_half), rho_min, rho_max); alpha <- rho alpha + R; beta <- rho beta + 1 - R.
local missing = need_run()
if missing then return missing end
local n = (#ARGV - 2) / 3
local unknown = {}
for i = 0, n - 1 do
  local tid = ARGV[3 + 3 * i]
  if redis.call('EXISTS', task_key(tid)) == 0 then table.insert(unknown, tid) end
end
if #unknown > 0 then
  return fail(404, 'unknown_task', 'no such task', { task_ids = unknown })
end
if redis.call('HGET', RUN, 'recipe') ~= 'spo' then
  return fail(409, 'wrong_recipe', 'consume applies to spo runs only; spopp places evidence at outcomes')
end
local done_key = P .. 'consumed'
local fingerprint = table.concat(ARGV, '\31', 3)
local prior = redis.call('HGET', done_key, ARGV[2])
if prior then
  prior = cjson.decode(prior)
  if prior.fp ~= fingerprint then
    return fail(409, 'idempotency_conflict', 'update_id reused with other items', { update_id = ARGV[2] })
  end
  return ok(prior.results)
end
local d_half, rmin, rmax = hnum(RUN, 'd_half'), hnum(RUN, 'rho_min'), hnum(RUN, 'rho_max')
local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
local results = {}
for i = 0, n - 1 do
  local tid, reward, drift = ARGV[3 + 3 * i], tonumber(ARGV[4 + 3 * i]), tonumber(ARGV[5 + 3 * i])
  local tk = task_key(tid)
  local rho = math.min(math.max(2 ^ (-drift / d_half), rmin), rmax)
  local a, b = hnum(tk, 'a'), hnum(tk, 'b')
  local w_old = weight(a, b, floor)
  a, b = rho * a + reward, rho * b + (1 - reward)
  redis.call('HSET', tk, 'a', fmt(a), 'b', fmt(b))
  local key = redis.call('ZSCORE', IDLE, tid)
  if key then
    -- Memorylessness: the remaining gap rescales with the weight; no fresh draw is needed.
    local gap = (tonumber(key) - clock) * w_old / weight(a, b, floor)
    redis.call('ZADD', IDLE, fmt(clock + gap), tid)
  end
  table.insert(results, { task_id = tid, rho = fmt(rho), alpha = fmt(a), beta = fmt(b), value = fmt(a / (a + b)) })
end
redis.call('HSET', done_key, ARGV[2], cjson.encode({ fp = fingerprint, results = results }))
redis.call('HINCRBY', RUN, 'consumed', 1)
return ok(results)
