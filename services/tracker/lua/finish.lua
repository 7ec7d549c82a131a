-- ARGV: prefix, version, reason. Marks the run finished at `version`, which must be its current
-- policy version. A repeat at the same version is a no-op (the first reason and time stay).
-- Finished: dispatch and publishing a new version are refused; outcomes, releases and reads go on.
local missing = need_run()
if missing then return missing end
local version = whole(ARGV[2], 0, MAX_VERSION)
if not version then return invalid('version', ARGV[2]) end
local reason = ARGV[3]
if reason == nil or reason == '' or #reason > MAX_REASON_CHARS then return invalid('reason', reason) end
local current = hnum(RUN, 'version')
if version ~= current then
  return fail(409, 'version_mismatch', 'run ' .. run_name() .. ' is at policy version ' .. current ..
    ', not ' .. version .. ': only the current version can be the final one', { policy_version = current })
end
if redis.call('HGET', RUN, 'status') == 'finished' then return ok({ changed = 0 }) end
redis.call('HSET', RUN, 'status', 'finished', 'final_version', version, 'finished_ms', now_ms(),
  'finish_reason', reason)
return ok({ changed = 1 })
