-- wrk script: POST the body in the file named by BODY, then print one JSON line of results. With
-- HEADER_LENGTH set, the body is an Open Inference Protocol binary request: a JSON header of that many
-- bytes, then the tensors' bytes.
local path = os.getenv("BODY")
local f = assert(io.open(path, "rb"))
wrk.method = "POST"
wrk.body = f:read("*a")
f:close()
local header_length = os.getenv("HEADER_LENGTH")
if header_length then
  wrk.headers["Content-Type"] = "application/octet-stream"
  wrk.headers["Inference-Header-Content-Length"] = header_length
else
  wrk.headers["Content-Type"] = "application/json"
end

function done(summary, latency, requests)
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "duration_us": %d, "p50_us": %d, "p99_us": %d, "mean_us": %.1f, ' ..
    '"non_2xx": %d, "connect": %d, "read": %d, "write": %d, "timeout": %d}\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    errors.status, errors.connect, errors.read, errors.write, errors.timeout))
end
