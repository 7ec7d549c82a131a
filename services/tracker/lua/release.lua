-- ARGV: prefix, request_id. Drops a lease without an outcome; a second release is a no-op.
local missing = need_run()
if missing then return missing end
local rid = ARGV[2]
local req = load_req(rid)
if not req then return fail(404, 'unknown_request', 'no such request', { request_ids = { rid } }) end
if req.state == 'reported' then
  return fail(409, 'already_reported', 'the request has an outcome; it cannot be released')
end
if req.state == 'leased' then
  local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
  if tonumber(req.exp) <= now_ms() then
    expire(rid, req, clock, floor)
    req.state = 'expired'
  else
    redis.call('HSET', req_key(rid), 'state', 'released')
    redis.call('ZREM', LEASES, rid)
    make_idle(req.task, tonumber(req.E), clock, floor)
    redis.call('HINCRBY', RUN, 'releases', 1)
    req.state = 'released'
  end
end
return ok(req)
