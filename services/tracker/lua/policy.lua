-- ARGV: prefix, version, snapshot. Advances the policy clock by exactly one version.
local missing = need_run()
if missing then return missing end
local version, snapshot = whole(ARGV[2], 1, MAX_VERSION), ARGV[3]
if not version then return invalid('version', ARGV[2]) end
if snapshot == nil or snapshot == '' or #snapshot > MAX_SNAPSHOT_CHARS then return invalid('snapshot', '') end
local current = hnum(RUN, 'version')
local cur_snap = redis.call('HGET', RUN, 'snapshot') or ''
if version == current + 1 then
  -- After the finish nothing trains on a new version: refuse it (a repeat of the final one is fine).
  local over = refuse_if_finished('no new policy versions')
  if over then return over end
  redis.call('HSET', RUN, 'version', version, 'snapshot', snapshot)
  return ok({ version = version, snapshot = snapshot, changed = 1 })
end
if version == current and snapshot == cur_snap then
  return ok({ version = version, snapshot = snapshot, changed = 0 })
end
local why = 'a gap in policy versions'
if version < current then why = 'a step back in policy versions' end
if version == current then why = 'another snapshot for a published version' end
return fail(409, 'policy_conflict', why, { policy_version = current, snapshot = cur_snap })
