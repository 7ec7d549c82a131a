-- ARGV: prefix, task ids... -> per task a, b, zr, dispatches, outcomes, live lease; plus the clock.
local missing = need_run()
if missing then return missing end
local now = now_ms()
local unknown, rows = {}, {}
for i = 2, #ARGV do
  local tk = task_key(ARGV[i])
  local f = redis.call('HMGET', tk, 'a', 'b', 'zr', 'dispatches', 'outcomes', 'req')
  if not f[1] then
    table.insert(unknown, ARGV[i])
  else
    local in_flight = 0
    if f[6] then
      local req = load_req(f[6])
      if live(req, now) then in_flight = 1 end
    end
    table.insert(rows, { ARGV[i], f[1], f[2], f[3], tonumber(f[4]), tonumber(f[5]), in_flight })
  end
end
if #unknown > 0 then
  return fail(404, 'unknown_task', 'no such task', { task_ids = unknown })
end
return ok({ version = hnum(RUN, 'version'), lam = redis.call('HGET', RUN, 'lam'),
  recipe = redis.call('HGET', RUN, 'recipe'), rows = rows })
