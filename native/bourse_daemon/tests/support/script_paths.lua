-- lua5.1 script_paths.lua BUCKET_LUA SEED STEPS
--
-- bucket.lua decides the common check (`admit_plain`) without `decide`'s tables. This runs
-- one random sequence of `checks` calls through two copies of the script, each on its own
-- in-memory Redis: the script as it is, and the script with `admit_plain` never taken. Both
-- must give the same answers and leave the same keys, fields and expiries after every call.
-- Now and then another program writes an odd value into a bucket's field, or a bucket
-- expires. Half the costs are distinct, so that the script's tables of numbers parsed
-- start again now and then; a definition is still stored as the requests spell it.
-- Prints how many checks `admit_plain` decided; exits 1 at the first difference.

local path, seed, steps = arg[1], tonumber(arg[2]), tonumber(arg[3])

-- The commands bucket.lua calls, on Lua tables, answering as Redis answers a script.
local function redis_in_memory(clock)
  local db, ttl = {}, {}
  local function sorted(key)
    local list = {}
    for member, score in pairs(db[key] or {}) do
      list[#list + 1] = { member, score }
    end
    table.sort(list, function(x, y)
      if x[2] ~= y[2] then
        return x[2] < y[2]
      end
      return x[1] < y[1]
    end)
    return list
  end
  local function within(score, low, high)
    local function bound(text)
      if text == '-inf' then
        return -math.huge, false
      elseif text == '+inf' then
        return math.huge, false
      elseif text:sub(1, 1) == '(' then
        return tonumber(text:sub(2)), true
      end
      return tonumber(text), false
    end
    local l, l_open = bound(low)
    local h, h_open = bound(high)
    return (l_open and score > l or not l_open and score >= l)
      and (h_open and score < h or not h_open and score <= h)
  end
  -- The members of `key` scored from `low` to `high`, in order.
  local function scored(key, low, high)
    local out = {}
    for _, entry in ipairs(sorted(key)) do
      if within(entry[2], low, high) then
        out[#out + 1] = entry
      end
    end
    return out
  end
  local function count(key)
    local n = 0
    for _ in pairs(db[key] or {}) do
      n = n + 1
    end
    return n
  end
  local commands = {
    TIME = function()
      return { tostring(math.floor(clock.now / 1e6)), tostring(clock.now % 1e6) }
    end,
    INFO = function()
      return 'run_id:0123456789abcdef\r\n'
    end,
    GET = function(key)
      return type(db[key]) == 'string' and db[key] or false
    end,
    SET = function(key, value, _, ms)
      db[key], ttl[key] = value, tonumber(ms)
      return { ok = 'OK' }
    end,
    HGET = function(key, field)
      return (db[key] or {})[field] or false
    end,
    HMGET = function(key, ...)
      local hash, out = db[key] or {}, {}
      for i, field in ipairs({ ... }) do
        out[i] = hash[field] or false
      end
      return out
    end,
    HSET = function(key, ...)
      local hash, pairs_given = db[key] or {}, { ... }
      db[key] = hash
      for i = 1, #pairs_given, 2 do
        hash[pairs_given[i]] = pairs_given[i + 1]
      end
      return #pairs_given / 2
    end,
    HDEL = function(key, field)
      if db[key] then
        db[key][field] = nil
      end
      return 1
    end,
    HLEN = count,
    HGETALL = function(key)
      local fields, out = {}, {}
      for field in pairs(db[key] or {}) do
        fields[#fields + 1] = field
      end
      table.sort(fields)
      for _, field in ipairs(fields) do
        out[#out + 1], out[#out + 2] = field, db[key][field]
      end
      return out
    end,
    PEXPIRE = function(key, ms)
      ttl[key] = tonumber(ms)
      return 1
    end,
    PTTL = function(key)
      return db[key] == nil and -2 or ttl[key] or -1
    end,
    ZADD = function(key, score, member)
      db[key] = db[key] or {}
      db[key][member] = tonumber(score)
      return 1
    end,
    ZREM = function(key, member)
      if db[key] then
        db[key][member] = nil
      end
      return 1
    end,
    ZCARD = count,
    ZSCORE = function(key, member)
      local score = (db[key] or {})[member]
      return score and string.format('%.17g', score) or false
    end,
    ZCOUNT = function(key, low, high)
      return #scored(key, low, high)
    end,
    ZRANGEBYSCORE = function(key, low, high)
      local out = {}
      for i, entry in ipairs(scored(key, low, high)) do
        out[i] = entry[1]
      end
      return out
    end,
    ZREMRANGEBYSCORE = function(key, low, high)
      local gone = scored(key, low, high)
      for _, entry in ipairs(gone) do
        db[key][entry[1]] = nil
      end
      return #gone
    end,
    ZRANGE = function(key, first, last, scores)
      local list, out = sorted(key), {}
      first, last = tonumber(first), tonumber(last)
      first = first < 0 and #list + first or first
      last = last < 0 and #list + last or last
      for i = first + 1, last + 1 do
        if list[i] then
          out[#out + 1] = list[i][1]
          if scores then
            out[#out + 1] = string.format('%.17g', list[i][2])
          end
        end
      end
      return out
    end,
  }
  local redis = {
    call = function(name, ...)
      return assert(commands[name], 'no command ' .. name)(...)
    end,
    error_reply = function(message)
      return { err = message }
    end,
  }
  -- Every key with its value (a hash's fields sorted) and expiry, one per line.
  local function dump()
    local keys, lines = {}, {}
    for key in pairs(db) do
      keys[#keys + 1] = key
    end
    table.sort(keys)
    for _, key in ipairs(keys) do
      local value = db[key]
      if type(value) == 'table' then
        local fields = {}
        for field, x in pairs(value) do
          fields[#fields + 1] = field .. '=' .. tostring(x)
        end
        table.sort(fields)
        value = table.concat(fields, ',')
      end
      lines[#lines + 1] = key .. ' ' .. value .. ' ttl=' .. tostring(ttl[key])
    end
    return table.concat(lines, '\n')
  end
  return redis, dump, db
end

-- `source` with `pattern` replaced by `replacement`, which must match exactly once.
local function replaced(source, pattern, replacement)
  local start, finish = string.find(source, pattern, 1, true)
  assert(start and not string.find(source, pattern, finish + 1, true), 'not once: ' .. pattern)
  return string.sub(source, 1, start - 1) .. replacement .. string.sub(source, finish + 1)
end

-- The script's entry point `run`, with its own `redis`, and the script's globals.
local function script(source, redis)
  local chunk = assert(loadstring(source .. '\nreturn run\n', '=bucket.lua'))
  local globals = setmetatable({ redis = redis }, { __index = _G })
  setfenv(chunk, globals)
  return chunk(), globals
end

local source = assert(io.open(path)):read('*a')
local counted = replaced(
  source,
  "return 'admitted ' .. (read[8] or '-'),",
  "plain_admitted = plain_admitted + 1\n  return 'admitted ' .. (read[8] or '-'),"
)
counted = replaced(counted, 'local function admit_plain(', 'plain_admitted = 0\nlocal function admit_plain(')
local general = replaced(
  source,
  'local line, marker, kept = admit_plain(now, k, at, read, max_wait)',
  'local line, marker, kept = nil, nil, nil'
)

local clock = { now = 1796520011000000 }
local redis_a, dump_a, db_a = redis_in_memory(clock)
local redis_b, dump_b, db_b = redis_in_memory(clock)
local run_a, counts = script(counted, redis_a)
local run_b = script(general, redis_b)

math.randomseed(seed)
local P = 'bourse:{7:binance}'
local credentials = { 'aa', 'bb', 'cc' }
local definitions = { { '1', '1' }, { '2', '0.1' }, { '5', '10' }, { '3', '0.5' } }
local costs = { '1', '1', '1', '2', '0.5' }
local fields = { 'c', 'r', 'b', 't', 'k', 'q', 'n' }
-- How the requests spell the definitions' numbers.
local spellings = {}
for _, definition in ipairs(definitions) do
  spellings[definition[1]], spellings[definition[2]] = true, true
end
-- Buckets given an odd definition by another program, until they expire.
local oddly_defined = {}
local odd_values = { 'nan', '-nan', 'inf', '-inf', '-0', '1e309', '', ' 5', '0x10', '1e-320' }

-- One `checks` call of 1 to 3 checks, as the daemon sends it (see script.rs).
local function random_call(step)
  local n = math.random(1, 3)
  local keys, args = { P .. ':r:' .. step }, { 'checks', '2000', tostring(n) }
  local function add(list, ...)
    for _, x in ipairs({ ... }) do
      list[#list + 1] = x
    end
  end
  for j = 1, n do
    local items = math.random() < 0.8 and 1 or 2
    local definition = definitions[math.random() < 0.85 and 1 + step % 2 or math.random(1, 4)]
    local max_wait = math.random() < 0.3 and tostring(math.random(1, 5000)) or '0'
    -- Assume busy now and then; on one server ('2', or '3' not busy) with its record.
    local busy = ({ '0', '0', '0', '0', '3', '3', '3', '3', '1', '2' })[math.random(1, 10)]
    if math.random() < 0.2 then
      -- A caller's own busy start, up to 10 s before the call.
      busy = busy .. ' ' .. tostring(math.random(0, 10000000))
    end
    local id = (math.random() < 0.3 and 'again' or tostring(step)) .. ':' .. j
    local record = busy:sub(1, 1) >= '2'
    add(args, '0', tostring(2 * items + 2 + (record and 1 or 0)), tostring(5 + 7 * items))
    add(args, id, max_wait, '250000', busy, tostring(items))
    for i = 1, items do
      local c = credentials[i == 1 and math.random(1, 2) or 3]
      local name = 'h' .. c .. ':1:a'
      add(keys, P .. ':b:' .. name, P .. ':w:' .. name)
      local cost = math.random() < 0.5 and costs[math.random(1, #costs)]
        or string.format('%.6f', math.random() * 2)
      add(args, definition[1], definition[2], cost, '1', 'c:h' .. c, 'k:' .. name, 'key:' .. c)
    end
    add(keys, P .. ':p', 'bourse:e{7:binance}')
    if record then
      add(keys, 'bourse:data')
    end
  end
  args[#args + 1] = '0'
  return keys, args
end

local function copy(list)
  local out = {}
  for i, x in ipairs(list) do
    out[i] = x
  end
  return out
end

-- Whether an odd value was written: then checks may fail (a malformed bucket).
local odd = false
for step = 1, steps do
  -- Mostly forward, by up to 3 s, sometimes back (a Redis clock set back).
  local r = math.random()
  local step_us = r < 0.05 and -math.random(1, 2000000)
    or math.random(0, r < 0.5 and 200000 or 3000000)
  clock.now = clock.now + step_us
  if math.random() < 0.05 then
    local field = ({ 'x', 'c:haa', 'k:hbb:1:a' })[math.random(1, 3)]
    local pause_end = tostring(clock.now + math.random(0, 3000000))
    for _, db in ipairs({ db_a, db_b }) do
      db[P .. ':p'] = db[P .. ':p'] or {}
      db[P .. ':p'][field] = pause_end
    end
  end
  if math.random() < 0.03 then
    -- The exchange's marker expires, or the server's record of its data is lost or names
    -- another node (a restart).
    local gone = ({ 'bourse:e{7:binance}', 'bourse:data', 'bourse:data' })[math.random(1, 3)]
    local value = gone == 'bourse:data' and math.random() < 0.5 and '1 0ther' or nil
    for _, db in ipairs({ db_a, db_b }) do
      db[gone] = value
    end
  end
  local bucket = P .. ':b:h' .. credentials[math.random(1, 3)] .. ':1:a'
  if math.random() < 0.05 and db_a[bucket] then
    -- Another program's write: `k` and `q` keep their time, so that they are read.
    local field, value = fields[math.random(1, #fields)], odd_values[math.random(1, #odd_values)]
    if field == 'k' or field == 'q' then
      value = (db_a[bucket].t or '0') .. ' ' .. value
    end
    for _, db in ipairs({ db_a, db_b }) do
      db[bucket][field] = value
    end
    odd = true
    oddly_defined[bucket] = oddly_defined[bucket] or field == 'c' or field == 'r'
  elseif math.random() < 0.02 then
    db_a[bucket], db_b[bucket], oddly_defined[bucket] = nil, nil, nil
  end
  local keys, args = random_call(step)
  local a = run_a(copy(keys), copy(args))
  local b = run_b(copy(keys), copy(args))
  local answer_a, answer_b = tostring(a[2] or a.err), tostring(b[2] or b.err)
  if answer_a ~= answer_b then
    print(string.format('step %d: answers differ\n%s\n--\n%s', step, answer_a, answer_b))
    os.exit(1)
  end
  if not odd and string.find(answer_a, 'error', 1, true) then
    print(string.format('step %d: a check failed: %s', step, answer_a))
    os.exit(1)
  end
  local store_a, store_b = dump_a(), dump_b()
  if store_a ~= store_b then
    print(string.format('step %d: stores differ\n%s\n--\n%s', step, store_a, store_b))
    os.exit(1)
  end
  for key, value in pairs(db_a) do
    local spelled = type(value) ~= 'table' or oddly_defined[key]
      or (value.c == nil or spellings[value.c]) and (value.r == nil or spellings[value.r])
    if not spelled then
      print(string.format('step %d: %s holds c=%s r=%s', step, key, value.c, value.r))
      os.exit(1)
    end
  end
  -- The call's run marker, compared above, is not read again.
  db_a[keys[1]], db_b[keys[1]] = nil, nil
end
print('admit_plain ' .. counts.plain_admitted)
