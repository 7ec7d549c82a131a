-- ARGV: prefix, request_id, ttl_ms. Drops a lease without an outcome; a second release is a
-- no-op. The finished request's record is kept for ttl_ms.
local missing = need_run()
if missing then return missing end
local rid = ARGV[2]
local ttl_ms = whole(ARGV[3], 1, 1e12)
if not ttl_ms then return invalid('ttl_ms', ARGV[3]) end
local req = load_req(rid)
if not req then return fail(404, 'unknown_request', 'no such request', { request_ids = { rid } }) end
if req.state == 'reported' then
  return fail(409, 'already_reported', 'the request has an outcome; it cannot be released')
end
if req.state == 'leased' then
  local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
  if tonumber(req.exp) <= now_ms() then
    expire(rid, req, clock, floor, ttl_ms)
    req.state = 'expired'
  else
    finish(rid, 'released', ttl_ms)
    make_idle(req.task, tonumber(req.E), clock, floor)
    redis.call('HINCRBY', RUN, 'releases', 1)
    req.state = 'released'
  end
end
return ok(req)
