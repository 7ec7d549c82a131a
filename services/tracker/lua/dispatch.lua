-- ARGV: prefix, stream start, seed, prior mass, worker_id, policy_version, max_requests,
-- idempotency_key, then max_requests draws; the j-th task popped keeps draw j for its return.
-- Reclaims expired leases, then pops the smallest race keys; the race clock moves to the last.
local missing = need_run()
if missing then return missing end
local worker, version, k, idem = ARGV[5], tonumber(ARGV[6]), tonumber(ARGV[7]), ARGV[8]
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
local stale = stale_stream(ARGV[2], ARGV[3], ARGV[4])
if stale then return stale end
local now = now_ms()
local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
local expired = redis.call('ZRANGEBYSCORE', LEASES, '-inf', now, 'LIMIT', 0, 4096)
for _, rid in ipairs(expired) do
  expire(rid, load_req(rid), clock, floor)
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
    'state', 'leased', 'worker', worker, 'E', ARGV[8 + (i + 1) / 2])
  redis.call('ZADD', LEASES, exp, rid)
  redis.call('HSET', tk, 'req', rid)
  redis.call('HINCRBY', tk, 'dispatches', 1)
  table.insert(out, { request_id = rid, task_id = tid, value = value, policy_version = version, exp = exp })
end
redis.call('HSET', RUN, 'clock', fmt(clock))
redis.call('HINCRBY', RUN, 'dispatches', #out)
redis.call('HINCRBY', RUN, 'draws', #out)
local resp = { policy_version = version, snapshot = snapshot, requests = out }
if idem ~= '' then
  redis.call('HSET', idem_key, 'fp', fingerprint, 'resp', cjson.encode(resp))
end
resp.draws_used = #out
return ok(resp)
