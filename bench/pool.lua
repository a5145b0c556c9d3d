-- wrk script: POST a different body of a pool per request, and time each request.
--
--   POOL=pool.index LATENCIES=out.txt wrk -tC -cC -d3s -s bench/pool.lua http://127.0.0.1:PORT
--
-- POOL names an index file: the pool file's name, then one request a line, "offset length" (a whole
-- HTTP/1.1 request, head and body, as bench/pools.py wrote it). Each thread maps the pool file
-- read-only (one copy in memory, whatever the threads) and walks the pool from its own starting
-- point, so that the connections send different bodies at any moment.
--
-- Timing: run with as many threads as connections (-tC -cC), so that each thread's one connection
-- alternates request() and response(); a request's time runs from the moment its bytes are handed to
-- wrk (after they were made) to its response's last byte, read with clock_gettime(CLOCK_MONOTONIC)
-- through LuaJIT's FFI. Every request's time goes to the file LATENCIES (microseconds, one a line):
-- no samples are added for coordinated omission, as wrk's own histogram does.
local ffi = require("ffi")
ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } bench_timespec;
int clock_gettime(int clk_id, bench_timespec *tp);
int open(const char *pathname, int flags);
int close(int fd);
void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
]]
local CLOCK_MONOTONIC, O_RDONLY, PROT_READ, MAP_SHARED = 1, 0, 1, 1
local ts = ffi.new("bench_timespec")

local function now_us()
  ffi.C.clock_gettime(CLOCK_MONOTONIC, ts)
  return tonumber(ts.tv_sec) * 1e6 + tonumber(ts.tv_nsec) / 1e3
end

-- The main state: one entry per thread, for done().
local threads = {}
local thread_count = 0

function setup(thread)
  thread:set("id", thread_count)
  thread_count = thread_count + 1
  table.insert(threads, thread)
end

-- Each thread's state.
local entries, base, position, started, cache = {}, nil, 1, nil, nil
latencies, failed, statuses = {}, 0, {}

function init(args)
  local index = assert(os.getenv("POOL"), "POOL: the pool's index file")
  local lines = io.lines(index)
  local data = lines()
  local size = 0
  for line in lines do
    local offset, length = line:match("^(%d+) (%d+)$")
    assert(offset, "a bad line in " .. index .. ": " .. line)
    table.insert(entries, {offset = tonumber(offset), length = tonumber(length)})
    size = math.max(size, tonumber(offset) + tonumber(length))
  end
  assert(#entries > 0, "an empty pool: " .. index)
  local fd = ffi.C.open(data, O_RDONLY)
  assert(fd >= 0, "cannot open " .. data)
  base = ffi.cast("const char *", ffi.C.mmap(nil, size, PROT_READ, MAP_SHARED, fd, 0))
  assert(ffi.cast("intptr_t", base) ~= -1, "cannot map " .. data)
  ffi.C.close(fd)
  local threads = math.max(1, tonumber(os.getenv("THREADS") or "1"))
  -- Small pools are made into Lua strings once (64 MiB at most over all threads); large ones are
  -- copied out of the mapping a request.
  if size * threads <= 64 * 1024 * 1024 then
    cache = {}
    for i, e in ipairs(entries) do
      cache[i] = ffi.string(base + e.offset, e.length)
    end
  end
  -- Threads start evenly spread over the pool.
  position = 1 + math.floor(id * #entries / threads) % #entries
end

function request()
  local i = position
  position = position % #entries + 1
  local raw
  if cache then
    raw = cache[i]
  else
    local e = entries[i]
    raw = ffi.string(base + e.offset, e.length)
  end
  started = now_us()
  return raw
end

function response(status, headers, body)
  latencies[#latencies + 1] = now_us() - started
  if status ~= 200 then
    failed = failed + 1
    local key = tostring(status)
    statuses[key] = (statuses[key] or 0) + 1
  end
end
function done(summary, latency, requests)
  local out = assert(io.open(assert(os.getenv("LATENCIES"), "LATENCIES: where the times go"), "w"))
  local count, failures, codes = 0, 0, {}
  for _, thread in ipairs(threads) do
    local times = thread:get("latencies")
    for i = 1, #times do
      out:write(string.format("%.1f\n", times[i]))
    end
    count = count + #times
    failures = failures + thread:get("failed")
    for code, n in pairs(thread:get("statuses")) do
      codes[#codes + 1] = string.format('"%s": %d', code, n)
    end
  end
  out:close()
  local errors = summary.errors
  io.write(string.format(
    '{"requests": %d, "timed": %d, "duration_us": %d, "failed": %d, "statuses": {%s}, ' ..
    '"connect": %d, "read": %d, "write": %d, "timeout": %d}\n',
    summary.requests, count, summary.duration, failures, table.concat(codes, ", "),
    errors.connect, errors.read, errors.write, errors.timeout))
end
