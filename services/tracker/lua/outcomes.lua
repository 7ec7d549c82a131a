-- ARGV: prefix, ttl_ms, max_workers, then (request_id, reward) pairs. Checked whole (422, then 404
-- before 409), then applied. A reported request's record is kept for ttl_ms: a repeat of the same
-- report answers the same meanwhile. A finished run still takes outcomes: late evidence lands.
local missing = need_run()
if missing then return missing end
local ttl_ms = whole(ARGV[2], 1, 1e12)
if not ttl_ms then return invalid('ttl_ms', ARGV[2]) end
local max_workers = whole(ARGV[3], 1, 1e9)
if not max_workers then return invalid('max_workers', ARGV[3]) end
local n = (#ARGV - 3) / 2
if n < 1 or n ~= math.floor(n) or n > MAX_BATCH then return invalid('outcome count', n) end
for i = 0, n - 1 do
  if not within(ARGV[5 + 2 * i], 0, 1) then return invalid('reward of ' .. ARGV[4 + 2 * i], ARGV[5 + 2 * i]) end
end
local reqs, unknown = {}, {}
for i = 0, n - 1 do
  local rid = ARGV[4 + 2 * i]
  local req = load_req(rid)
  if not req then table.insert(unknown, rid) end
  reqs[rid] = req
end
if #unknown > 0 then
  return fail(404, 'unknown_request', 'no such request', { request_ids = unknown })
end
local now = now_ms()
local pending, bad_reward, not_live = {}, {}, {}
for i = 0, n - 1 do
  local rid, reward = ARGV[4 + 2 * i], tonumber(ARGV[5 + 2 * i])
  local req = reqs[rid]
  local known = pending[rid] or (req.state == 'reported' and tonumber(req.reward))
  if known then
    if known ~= reward then table.insert(bad_reward, rid) end
  elseif not live(req, now) then
    table.insert(not_live, rid)
  else
    pending[rid] = reward
  end
end
if #bad_reward > 0 then
  return fail(409, 'outcome_conflict', 'a different reward was already reported', { request_ids = bad_reward })
end
if #not_live > 0 then
  return fail(409, 'lease_not_live', 'lease expired or released: the outcome is not counted', { request_ids = not_live })
end
local spopp = redis.call('HGET', RUN, 'recipe') == 'spopp'
local lam, clock, floor = hnum(RUN, 'lam'), hnum(RUN, 'clock'), hnum(RUN, 'floor')
local applied, late, overtaken, distance, results = 0, 0, 0, 0, {}
local version = hnum(RUN, 'version')
-- Request ids are 'r' .. the dispatch sequence: an outcome whose request was dispatched before
-- one already reported was overtaken (outcomes come back out of dispatch order).
local newest = hnum(RUN, 'newest_reported') or 0
for i = 0, n - 1 do
  local rid, reward = ARGV[4 + 2 * i], tonumber(ARGV[5 + 2 * i])
  local req = reqs[rid]
  if req.state == 'leased' then
    local tk = task_key(req.task)
    if spopp then
      -- Event-time placement at the request's own policy coordinate (eq. 3, incremental form).
      -- z <= version * lam stays finite; the shrink and the weight lie in [0, 1], and after a
      -- shrink the new term has weight 1, so a + b >= min(a0 + b0, 1) > 0 ever after.
      local z = tonumber(req.ver) * lam
      local a, b, zr = hnum(tk, 'a'), hnum(tk, 'b'), hnum(tk, 'zr')
      if z > zr then
        local shrink = math.exp(zr - z)
        a, b, zr = a * shrink, b * shrink, z
      end
      local w = math.exp(z - zr)
      a, b = a + w * reward, b + w * (1 - reward)
      redis.call('HSET', tk, 'a', fmt(a), 'b', fmt(b), 'zr', fmt(zr))
    end
    redis.call('HSET', req_key(rid), 'reward', ARGV[5 + 2 * i])
    finish(rid, 'reported', ttl_ms)
    -- Once per request (a repeat finds it reported), to the worker that leased it; a worker the
    -- bound left without stats stays without (the outcome itself always counts).
    if req.worker and not refuse_new_worker(req.worker, max_workers) then
      worker_seen(req.worker, now)
      redis.call('HINCRBY', W_OUTCOMES, req.worker, 1)
    end
    redis.call('HINCRBY', tk, 'outcomes', 1)
    make_idle(req.task, tonumber(req.E), clock, floor)
    req.state = 'reported'
    applied = applied + 1
    -- Reported after a newer policy was published: the outcome came back late.
    if tonumber(req.ver) < version then late = late + 1 end
    local seq = tonumber(string.sub(rid, 2)) or 0
    -- Its distance: how far in dispatch order the newest reported request is past it.
    if seq < newest then
      overtaken, distance = overtaken + 1, distance + newest - seq
    else
      newest = seq
    end
  end
  local adv = ''
  if spopp then adv = fmt(reward - tonumber(req.value)) end
  table.insert(results, { request_id = rid, value = req.value, advantage = adv })
end
redis.call('HINCRBY', RUN, 'outcomes', applied)
if late > 0 then redis.call('HINCRBY', RUN, 'late_outcomes', late) end
if overtaken > 0 then
  redis.call('HINCRBY', RUN, 'overtaken_outcomes', overtaken)
  redis.call('HINCRBY', RUN, 'reorder_distance', distance)
end
if applied > 0 then redis.call('HSET', RUN, 'newest_reported', newest) end
return ok({ results = results })
