-- ARGV: prefix, request ids... -> per request its state, task and version ('unknown' when this run
-- never issued it, or its record has expired). Reads only.
local missing = need_run()
if missing then return missing end
local now = now_ms()
local rows = {}
for i = 2, #ARGV do
  local req = load_req(ARGV[i])
  if not req then
    table.insert(rows, { ARGV[i], 'unknown', '', -1, 0 })
  else
    local state = req.state
    if state == 'leased' and tonumber(req.exp) <= now then state = 'expired' end
    table.insert(rows, { ARGV[i], state, req.task, tonumber(req.ver), tonumber(req.exp) })
  end
end
return ok({ rows = rows })
