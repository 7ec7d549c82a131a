-- ARGV: prefix. The run's hash plus counts judged at Redis's current time.
local missing = need_run()
if missing then return missing end
local raw = redis.call('HGETALL', RUN)
local run = {}
for i = 1, #raw, 2 do run[raw[i]] = raw[i + 1] end
run.tasks = redis.call('SCARD', TASKS)
run.idle = redis.call('ZCARD', IDLE)
run.in_flight = redis.call('ZCOUNT', LEASES, '(' .. now_ms(), '+inf')
return ok(run)
