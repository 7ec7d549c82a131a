-- ARGV: prefix, worker_id, trajectories, episodes, max_workers. A worker's own cumulative counts:
-- the tracker keeps the largest it has seen, so a retried or reordered heartbeat, or a restarted
-- worker counting again from 0, never lowers them. Taken on a finished run too (the last one).
local missing = need_run()
if missing then return missing end
local worker = ARGV[2]
if worker == nil or worker == '' or #worker > 128 then return invalid('worker_id', worker) end
local traj = whole(ARGV[3], 0, MAX_COUNT)
if not traj then return invalid('trajectories', ARGV[3]) end
local eps = whole(ARGV[4], 0, MAX_COUNT)
if not eps then return invalid('episodes', ARGV[4]) end
local max_workers = whole(ARGV[5], 1, 1e9)
if not max_workers then return invalid('max_workers', ARGV[5]) end
local crowded = refuse_new_worker(worker, max_workers)
if crowded then return crowded end
local now = now_ms()
worker_seen(worker, now)
if traj > hnum(W_TRAJ, worker) then redis.call('HSET', W_TRAJ, worker, ARGV[3]) end
if eps > hnum(W_EPS, worker) then redis.call('HSET', W_EPS, worker, ARGV[4]) end
-- Counts go back as strings: cjson would round numbers above 1e14.
local function get(key) return redis.call('HGET', key, worker) end
return ok({
  leases = get(W_LEASES), outcomes = get(W_OUTCOMES), trajectories = get(W_TRAJ), episodes = get(W_EPS),
  seen_ms = get(W_SEEN), run_status = redis.call('HGET', RUN, 'status') or 'running',
})
