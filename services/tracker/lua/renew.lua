-- ARGV: prefix, request_id. Extends a live lease by lease_seconds from now.
local missing = need_run()
if missing then return missing end
local rid = ARGV[2]
local req = load_req(rid)
if not req then return fail(404, 'unknown_request', 'no such request', { request_ids = { rid } }) end
local now = now_ms()
if not live(req, now) then
  local state = req.state
  if state == 'leased' then state = 'expired' end
  return fail(409, 'lease_not_live', 'only a live lease can be renewed', { state = state })
end
local exp = now + hnum(RUN, 'lease_ms')
redis.call('HSET', req_key(rid), 'exp', exp)
redis.call('ZADD', LEASES, exp, rid)
req.exp = exp
return ok(req)
