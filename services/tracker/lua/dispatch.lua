-- ARGV: prefix, stream start, seed, prior mass, worker_id, policy_version, max_requests,
-- idempotency_key, ttl_ms, max_workers, then max_requests draws; the j-th task popped keeps draw
-- j for its return. Reclaims expired leases, then pops the smallest race keys; the race clock
-- moves to the last. The idempotency record (and every request that finishes here) is kept for
-- ttl_ms. A finished run refuses first, before the version check, so a replica at any version
-- learns that the run is over.
local missing = need_run()
if missing then return missing end
local worker, idem = ARGV[5], ARGV[8]
local version = whole(ARGV[6], 0, MAX_VERSION)
if not version then return invalid('policy_version', ARGV[6]) end
local k = whole(ARGV[7], 1, MAX_REQUESTS)
if not k or #ARGV ~= 10 + k then return invalid('max_requests', ARGV[7]) end
local ttl_ms = whole(ARGV[9], 1, 1e12)
if not ttl_ms then return invalid('ttl_ms', ARGV[9]) end
local max_workers = whole(ARGV[10], 1, 1e9)
if not max_workers then return invalid('max_workers', ARGV[10]) end
if worker == '' or #worker > 128 or idem == nil then return invalid('worker_id', worker) end
local bad = bad_draws(11, k)
if bad then return bad end
local over = refuse_if_finished('no new leases')
if over then return over end
local fingerprint = worker .. '\31' .. ARGV[6] .. '\31' .. ARGV[7]
local idem_key = P .. 'idem:' .. idem
if idem ~= '' then
  local stored = redis.call('HMGET', idem_key, 'fp', 'resp')
  if stored[1] then
    if stored[1] ~= fingerprint then
      return fail(409, 'idempotency_conflict', 'idempotency key reused with another body')
    end
    local resp = cjson.decode(stored[2])
    resp.draws_used = 0
    return ok(resp)
  end
end
local current = hnum(RUN, 'version')
local snapshot = redis.call('HGET', RUN, 'snapshot') or ''
if version ~= current then
  return fail(409, 'stale_policy', 'policy version is not current: drain and reload',
    { policy_version = current, snapshot = snapshot })
end
local crowded = refuse_new_worker(worker, max_workers)
if crowded then return crowded end
local stale = stale_stream(ARGV[2], ARGV[3], ARGV[4])
if stale then return stale end
local now = now_ms()
local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
local expired = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, 4096)
for _, rid in ipairs(expired) do
  local req = load_req(rid)
  if req then
    expire(rid, req, clock, floor, ttl_ms)
  else
    redis.call('ZREM', LEASES, rid) -- no record to reclaim from (cannot happen: leases never expire)
  end
end
local popped = redis.call('ZPOPMIN', IDLE, k)
local lease_ms = hnum(RUN, 'lease_ms')
local exp = now + lease_ms
local out = {}
for i = 1, #popped, 2 do
  local tid = popped[i]
  clock = tonumber(popped[i + 1])
  local tk = task_key(tid)
  local a, b = hnum(tk, 'a'), hnum(tk, 'b')
  local value = fmt(a / (a + b))
  local rid = 'r' .. redis.call('HINCRBY', RUN, 'reqseq', 1)
  redis.call('HSET', req_key(rid), 'task', tid, 'ver', version, 'value', value, 'exp', exp,
    'state', 'leased', 'worker', worker, 'E', ARGV[10 + (i + 1) / 2])
  redis.call('ZADD', LEASES, exp, rid)
  redis.call('HSET', tk, 'req', rid)
  redis.call('HINCRBY', tk, 'dispatches', 1)
  table.insert(out, { request_id = rid, task_id = tid, value = value, policy_version = version, exp = exp })
end
redis.call('HSET', RUN, 'clock', fmt(clock))
redis.call('HINCRBY', RUN, 'dispatches', #out)
redis.call('HINCRBY', RUN, 'draws', #out)
worker_seen(worker, now)
redis.call('HINCRBY', W_LEASES, worker, #out)
local resp = { policy_version = version, snapshot = snapshot, requests = out }
if idem ~= '' then
  redis.call('HSET', idem_key, 'fp', fingerprint, 'resp', cjson.encode(resp))
  redis.call('PEXPIRE', idem_key, ttl_ms)
end
resp.draws_used = #out
return ok(resp)
