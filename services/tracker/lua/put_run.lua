-- ARGV: prefix, run, config_json, then field/value pairs of the run's derived settings
-- (recipe, lam, floor, lease_ms, seed, prior_mass, d_half, rho_min, rho_max, snapshot).
local existing = redis.call('HGET', RUN, 'config')
if existing then
  if existing == ARGV[3] then return ok({ created = 0 }) end
  return fail(409, 'run_conflict', 'run exists with another configuration', { config = cjson.decode(existing) })
end
redis.call('HSET', RUN, 'config', ARGV[3], 'version', 0, 'clock', '0', 'reqseq', 0, 'draws', 0,
  'dispatches', 0, 'outcomes', 0, 'releases', 0, 'expirations', 0, 'consumed', 0)
for i = 4, #ARGV, 2 do
  if ARGV[i + 1] ~= '' then redis.call('HSET', RUN, ARGV[i], ARGV[i + 1]) end
end
redis.call('SADD', 'spopp:runs', ARGV[2])
return ok({ created = 1 })
