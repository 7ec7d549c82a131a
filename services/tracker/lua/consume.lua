-- ARGV: prefix, update_id, ttl_ms, then (task_id, reward, drift) in learner order. SPO only.
-- rho = clip(2^(-D/d_half), rho_min, rho_max); alpha <- rho alpha + R; beta <- rho beta + 1 - R.
-- Once per update_id: its record (the items' fingerprint and the results) is kept for ttl_ms,
-- so a retry meanwhile answers the first results and applies nothing.
local missing = need_run()
if missing then return missing end
local update_id = ARGV[2]
local ttl_ms = whole(ARGV[3], 1, 1e12)
if not ttl_ms then return invalid('ttl_ms', ARGV[3]) end
local n = (#ARGV - 3) / 3
if n < 1 or n ~= math.floor(n) or n > MAX_BATCH then return invalid('item count', n) end
for i = 0, n - 1 do
  if not within(ARGV[5 + 3 * i], 0, 1) then return invalid('reward of ' .. ARGV[4 + 3 * i], ARGV[5 + 3 * i]) end
  if not within(ARGV[6 + 3 * i], 0, MAX_DRIFT) then return invalid('drift of ' .. ARGV[4 + 3 * i], ARGV[6 + 3 * i]) end
end
local unknown = {}
for i = 0, n - 1 do
  local tid = ARGV[4 + 3 * i]
  if redis.call('EXISTS', task_key(tid)) == 0 then table.insert(unknown, tid) end
end
if #unknown > 0 then
  return fail(404, 'unknown_task', 'no such task', { task_ids = unknown })
end
if redis.call('HGET', RUN, 'recipe') ~= 'spo' then
  return fail(409, 'wrong_recipe', 'consume applies to spo runs only; spopp places evidence at outcomes')
end
local done_key = P .. 'upd:' .. update_id
local fingerprint = table.concat(ARGV, '\31', 4)
-- Records written before they expired lived in one hash per run: still honoured when found.
local prior = redis.call('GET', done_key) or redis.call('HGET', P .. 'consumed', update_id)
if prior then
  prior = cjson.decode(prior)
  if prior.fp ~= fingerprint then
    return fail(409, 'idempotency_conflict', 'update_id reused with other items', { update_id = update_id })
  end
  return ok(prior.results)
end
local d_half, rmin, rmax = hnum(RUN, 'd_half'), hnum(RUN, 'rho_min'), hnum(RUN, 'rho_max')
local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
local results = {}
for i = 0, n - 1 do
  local tid, reward, drift = ARGV[4 + 3 * i], tonumber(ARGV[5 + 3 * i]), tonumber(ARGV[6 + 3 * i])
  local tk = task_key(tid)
  -- drift / d_half <= 1e12: 2^-x underflows to 0 at worst, then the clip lifts it to rho_min.
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
redis.call('SET', done_key, cjson.encode({ fp = fingerprint, results = results }), 'PX', ttl_ms)
redis.call('HINCRBY', RUN, 'consumed', 1)
return ok(results)
