-- ARGV: prefix, then (task_id, alpha0, beta0, E) per task. All-or-nothing: conflicts first.
local missing = need_run()
if missing then return missing end
local n = (#ARGV - 1) / 4
local conflicts = {}
local fresh = {}
for i = 0, n - 1 do
  local tid, a0, b0 = ARGV[2 + 4 * i], tonumber(ARGV[3 + 4 * i]), tonumber(ARGV[4 + 4 * i])
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
for _, i in ipairs(fresh) do
  local tid = ARGV[2 + 4 * i]
  local tk = task_key(tid)
  redis.call('HSET', tk, 'a0', ARGV[3 + 4 * i], 'b0', ARGV[4 + 4 * i], 'a', ARGV[3 + 4 * i],
    'b', ARGV[4 + 4 * i], 'zr', '0', 'dispatches', 0, 'outcomes', 0)
  redis.call('SADD', TASKS, tid)
  make_idle(tid, tonumber(ARGV[5 + 4 * i]), clock, floor)
end
return ok({ created = #fresh, unchanged = n - #fresh })
