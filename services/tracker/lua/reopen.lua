-- ARGV: prefix, version. Undoes a finish at `version` (the run's current, final version), so that
-- a run whose budget grew trains on; on a running run it is a no-op.
local missing = need_run()
if missing then return missing end
local version = whole(ARGV[2], 0, MAX_VERSION)
if not version then return invalid('version', ARGV[2]) end
local current = hnum(RUN, 'version')
if version ~= current then
  return fail(409, 'version_mismatch', 'run ' .. run_name() .. ' is at policy version ' .. current ..
    ', not ' .. version, { policy_version = current })
end
if redis.call('HGET', RUN, 'status') ~= 'finished' then return ok({ changed = 0 }) end
redis.call('HDEL', RUN, 'status', 'final_version', 'finished_ms', 'finish_reason')
return ok({ changed = 1 })
