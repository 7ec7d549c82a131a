-- ARGV: prefix, run, config_json, max_runs, then field/value pairs of the run's derived settings
-- (recipe, lam, floor, lease_ms, seed, stream, prior_mass, d_half, rho_min, rho_max, snapshot).
-- Every field is checked against the LIMITS before the run is written; a new run past max_runs
-- (the tracker's bound on runs, so that no caller grows Redis or a scrape without bound) is 409.
if (#ARGV - 4) % 2 ~= 0 then return invalid('field/value pairs', #ARGV) end
local max_runs = tonumber(ARGV[4])
if not max_runs or max_runs < 1 then return invalid('max_runs', ARGV[4]) end
local f = {}
for i = 5, #ARGV, 2 do f[ARGV[i]] = ARGV[i + 1] end
if f.recipe ~= 'spopp' and f.recipe ~= 'spo' then return invalid('recipe', f.recipe) end
if not positive(f.lam, MAX_LAM) then return invalid('lam', f.lam) end
if not positive(f.floor, 1) then return invalid('floor', f.floor) end
if not whole(f.lease_ms, MIN_LEASE_MS, MAX_LEASE_MS) then return invalid('lease_ms', f.lease_ms) end
if type(f.seed) ~= 'string' or not string.match(f.seed, '^%d+$') or #f.seed > 19 then
  return invalid('seed', f.seed)
end
if type(f.stream) ~= 'string' or #f.stream == 0 or #f.stream > MAX_STREAM_CHARS then
  return invalid('stream', f.stream)
end
if not within(f.prior_mass, MIN_PRIOR_MASS, MAX_PRIOR) then return invalid('prior_mass', f.prior_mass) end
if not within(f.d_half, MIN_D_HALF, MAX_D_HALF) then return invalid('d_half', f.d_half) end
local rmin, rmax = within(f.rho_min, MIN_RHO, 1), within(f.rho_max, MIN_RHO, 1)
if not rmin or not rmax or rmin > rmax then return invalid('rho_min/rho_max', f.rho_min) end
if f.snapshot == nil or #f.snapshot > MAX_SNAPSHOT_CHARS then return invalid('snapshot', '') end
if ARGV[2] == nil or ARGV[3] == nil then return invalid('run and config', '') end
local existing = redis.call('HGET', RUN, 'config')
if existing then
  if existing == ARGV[3] then return ok({ created = 0 }) end
  return fail(409, 'run_conflict', 'run exists with another configuration', { config = cjson.decode(existing) })
end
if redis.call('SCARD', 'spopp:runs') >= max_runs then
  return fail(409, 'too_many_runs', 'this tracker keeps at most ' .. ARGV[4] .. ' runs', { max_runs = max_runs })
end
redis.call('HSET', RUN, 'config', ARGV[3], 'version', 0, 'clock', '0', 'reqseq', 0, 'draws', 0,
  'dispatches', 0, 'outcomes', 0, 'releases', 0, 'expirations', 0, 'consumed', 0)
for i = 5, #ARGV, 2 do
  if ARGV[i + 1] ~= '' then redis.call('HSET', RUN, ARGV[i], ARGV[i + 1]) end
end
redis.call('SADD', 'spopp:runs', ARGV[2])
return ok({ created = 1 })
