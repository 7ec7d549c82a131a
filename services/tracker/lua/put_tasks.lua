-- ARGV: prefix, stream start, seed, prior mass, n, then (task_id, alpha0, beta0) per task, then n
-- draws: the j-th new task enters the race with draw j. All-or-nothing: every argument is checked,
-- then conflicts, before the first write.
local missing = need_run()
if missing then return missing end
local n = whole(ARGV[5], 0, MAX_TASKS_PER_CALL)
if not n or #ARGV ~= 5 + 4 * n then return invalid('task count', ARGV[5]) end
local D = 6 + 3 * n
-- Priors in (0, MAX_PRIOR]: an outcomes-form prior of the smallest mass may lie below MIN_PRIOR,
-- never at 0, so a + b > 0 and the value a / (a + b) is always a number.
for i = 0, n - 1 do
  if not positive(ARGV[7 + 3 * i], MAX_PRIOR) then return invalid('alpha0 of ' .. ARGV[6 + 3 * i], ARGV[7 + 3 * i]) end
  if not positive(ARGV[8 + 3 * i], MAX_PRIOR) then return invalid('beta0 of ' .. ARGV[6 + 3 * i], ARGV[8 + 3 * i]) end
end
local bad = bad_draws(D, n)
if bad then return bad end
-- The hint first: outcome-form priors were computed with the prior mass it names.
local stale = stale_stream(ARGV[2], ARGV[3], ARGV[4])
if stale then return stale end
local conflicts = {}
local fresh = {}
for i = 0, n - 1 do
  local tid, a0, b0 = ARGV[6 + 3 * i], tonumber(ARGV[7 + 3 * i]), tonumber(ARGV[8 + 3 * i])
  local tk = task_key(tid)
  local old = redis.call('HMGET', tk, 'a0', 'b0')
  if old[1] then
    if tonumber(old[1]) ~= a0 or tonumber(old[2]) ~= b0 then
      table.insert(conflicts, tid)
    end
  else
    table.insert(fresh, i)
  end
end
if #conflicts > 0 then
  return fail(409, 'prior_conflict', 'tasks exist with another prior', { task_ids = conflicts })
end
local clock, floor = hnum(RUN, 'clock'), hnum(RUN, 'floor')
for j, i in ipairs(fresh) do
  local tid, a0, b0 = ARGV[6 + 3 * i], ARGV[7 + 3 * i], ARGV[8 + 3 * i]
  redis.call('HSET', task_key(tid), 'a0', a0, 'b0', b0, 'a', a0, 'b', b0, 'zr', '0',
    'dispatches', 0, 'outcomes', 0)
  redis.call('SADD', TASKS, tid)
  make_idle(tid, tonumber(ARGV[D + j - 1]), clock, floor)
end
redis.call('HINCRBY', RUN, 'draws', #fresh)
return ok({ created = #fresh, unchanged = n - #fresh, draws_used = #fresh })
