-- ARGV: prefix, expected config JSON, new config JSON. Replaces the run's stored config when it is
-- still the one the caller read (the caller computed the new one: another max_updates), so that
-- two concurrent changes cannot lose one; the run's derived settings are unchanged by a budget.
local missing = need_run()
if missing then return missing end
if ARGV[2] == nil or ARGV[3] == nil then return invalid('configs', '') end
local current = redis.call('HGET', RUN, 'config')
if current ~= ARGV[2] then
  return fail(409, 'run_conflict', 'the run configuration changed while the budget was read; try again',
    { config = cjson.decode(current) })
end
redis.call('HSET', RUN, 'config', ARGV[3])
return ok({ changed = (ARGV[2] ~= ARGV[3]) and 1 or 0 })
