-- ARGV: prefix, worker_id, ttl_ms. Gives back every live lease the worker holds, as a release
-- of each would (its task returns to the race with the draw reserved at dispatch); a lease past
-- its expiry is expired instead, as any reader would find it. A restarted replica calls this
-- before its first dispatch: the leases of its previous life have no episode behind them any
-- more, and waiting out their expiry would keep their tasks out of the race for minutes.
-- O(live leases of the run): one walk of the lease table, which is bounded by the task count.
local missing = need_run()
if missing then return missing end
local worker = ARGV[2]
if worker == nil or worker == '' or #worker > 128 then return invalid('worker_id', worker) end
local ttl_ms = whole(ARGV[3], 1, 1e12)
if not ttl_ms then return invalid('ttl_ms', ARGV[3]) end
local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
local now = now_ms()
local released, expired = {}, 0
for _, rid in ipairs(redis.call('ZRANGE', LEASES, 0, -1)) do
  local req = load_req(rid)
  if req ~= nil and req.worker == worker and req.state == 'leased' then
    if tonumber(req.exp) <= now then
      expire(rid, req, clock, floor, ttl_ms)
      expired = expired + 1
    else
      finish(rid, 'released', ttl_ms)
      make_idle(req.task, tonumber(req.E), clock, floor)
      released[#released + 1] = rid
    end
  end
end
if #released > 0 then redis.call('HINCRBY', RUN, 'releases', #released) end
return ok({ released = released, expired = expired })
