-- ARGV: prefix, n. Reserves n counters of the run's draw stream; answers start, seed, prior mass.
local missing = need_run()
if missing then return missing end
local n = tonumber(ARGV[2])
local stop = redis.call('HINCRBY', RUN, 'draws', n)
local f = redis.call('HMGET', RUN, 'seed', 'prior_mass')
return ok({ start = stop - n, seed = f[1], prior_mass = f[2] })
