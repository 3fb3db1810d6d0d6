-- The bourse_core bucket (native/bourse_core/src/bucket.rs and table.rs), run atomically
-- inside Redis on the Redis server's clock, so every daemon sharing the server sees one
-- table and one time.
--
-- Times are microseconds from Redis's TIME: exact in Lua's doubles. Whole numbers
-- are stored as integers, others with %.17g, which round-trips every double (a definition
-- as the requests spell it, which reads back exactly too). Redis >= 5
-- replicates a script's effects, not the script, so reading TIME is allowed.
--
-- The file ends with `run`, the entry point: script.rs appends a line that either registers
-- it as the function of a library (Redis >= 7: `FUNCTION LOAD`, then `FCALL`, so the local
-- functions below are created once, at load) or calls it (a script: `EVALSHA`/`EVAL`).
--
-- Layout 2 (P is the prefix, E the exchange as <byte length>:<bytes>, C "h" and the
-- credential's keyed fingerprint (32 hex digits) or "-" for the public pool, A the axis as
-- <length>:<bytes>). No name holds a credential. Every key of an exchange carries the hash
-- tag {E}, so on Redis Cluster it lives in one slot:
--
--   P:{E}:b:C:A  hash    c, r: the definition (absent until a check pays under one: the
--                        key has only debt, or its checks were refused);
--                        b, t: b + r * (now - t) tokens have accrued since the last payment;
--                        without a definition, b is minus the debt;
--                        s: present once a check saw the key without a definition: its
--                        accrual starts at t (read only without a definition);
--                        f: the credential's shown fingerprint ("key:" and 8 hex digits);
--                        w:<booking id>: "<ready_at> <cost> <booked_at> [<refund>]"
--                        of each booking (the refund only when below the cost);
--                        h: the pause end its bookings were last moved behind;
--                        q: "<t> <refunds>", written with t: what the bookings give
--                        back together when paid again is at most <refunds> (absent or
--                        outdated: unknown; any later write of t outdates it);
--                        k: "<t> <expiry>", written with t by a check that paid here
--                        and found no bookings: the key had none then and expires no
--                        earlier than <expiry> (ms, Redis clock); any later write of t
--                        (by every version of this script) outdates it;
--                        n: when its definition was last written (new or changed), or
--                        on a key holding only debt, when its debt was first recorded:
--                        a refund gives back only to the bucket of the `n` it paid under;
--                        z: when the bucket was last lowered by other than payments and
--                        its cap: its definition changed, a `sync`, or its time taken
--                        back to a Redis clock set back (then the time it had); see
--                        `refunds`
--   P:{E}:w:C:A  zset    booking id -> lapse_at
--   P:{E}:p      hash    pause ends: "x" the exchange, "c:C" a credential, "k:C:A" a key
--   P:{E}:o:C    string  the credential's backoff: "<count> <end of its last pause>", the
--                        limited replies without a usable wait counted since its last
--                        success
--   P:{E}:o      string  the exchange's backoff, as a credential's: the replies that limited
--                        the whole exchange (its IP), whichever credential got them
--   P:{E}:r:<n>  string  the answers of the `checks`, `record`, `back_off` or `refunds` call
--                        numbered n (by its daemon), as it returned them, written when it
--                        ran (a `checks` call's after the time it ran, µs, and a space);
--                        lives twice the daemon's Redis timeout (a `checks` or `record`
--                        call whose answer is read late: until the end of that window)
--   P:e{E}       string  "<began> [<run_id>]": when this exchange's state began (for
--                        assume_busy_at_start), and on which node (see state_began); not
--                        dropped by resets, so a reset never looks like lost state
--   P:data       string  "<since> <run_id>": since when this Redis server's data is whole
--                        (`data_since`); on one server only (a cluster's nodes have no
--                        key of their own); one key, which never expires
--
-- Everything expires: buckets by themselves (PEXPIRE on every write, except a payment on a
-- bucket without bookings that `k` shows kept long enough) once they would behave as new
-- (full, no bookings left, idle for longer than the delay they last answered; a bucket paid
-- without bookings up to KEEP_AHEAD later);
-- bookings with their bucket; pauses after their last end; a backoff count its lapse after
-- the last reply that counted into it; an exchange's marker a day
-- after its last check, or after its longest-lived bucket if later; P:data, one key, never.
--
-- ARGV[1] is the operation, the last ARGV the deadline: the latest time (µs, Redis clock) at
-- which the caller still waits for the answer, 0 for none (taken off the end by `run`, so
-- the operations below see only their own arguments). Past it the script does nothing and
-- answers the error "LATE <now>": the caller was told Redis was unavailable, so its work
-- must not be done.

-- The keys and arguments of the call being run (set by `run`).
local KEYS, ARGV

-- Lua's libraries as locals, bound by `run` when it is first called (a function library sees
-- them only then): a global is looked up through the sandbox on every use, a local is not.
local function libraries()
  return math, string, table, tonumber, tostring, ipairs, pairs, pcall, type, redis.call
end
local math, string, table, tonumber, tostring, ipairs, pairs, pcall, type, call

local MAX_WAIT = 1e15 -- µs, about 31 years: longer waits saturate here (bourse_core's MAX_WAIT_NS)
local MAX_BOOKINGS = 256 -- most bookings one bucket holds (bourse_core's MAX_BOOKINGS)
local MARGIN = 1000000 -- µs a key outlives the moment it would behave as new (bourse_core's KEEP_MARGIN_MS)
local DEBT_TTL = 86400e6 -- µs a key holding only recorded debt is kept after its last use (bourse_core's DEBT_KEEP_MS)
local MARKER_TTL = 86400e6 -- µs an exchange's marker outlives its last check, at least
local MARKER_SLACK = 3600e6 -- µs a marker's lifetime is set beyond MARKER_TTL when renewed

-- A number as stored: an integral one (µs times, whole costs) as its digits, any other with
-- %.17g; both read back exactly, and '%d' costs far less inside Redis.
local function fmt(x)
  if x % 1 == 0 and x > -1e18 and x < 1e18 then
    return string.format('%d', x)
  end
  return string.format('%.17g', x)
end

-- The running call's time and its text, formatted at most once per call (see `run`).
local call_now, call_now_text

-- A time (µs) as stored: `fmt`, the call's own time formatted once.
local function fmt_time(x)
  if x ~= call_now then
    return fmt(x)
  end
  call_now_text = call_now_text or fmt(x)
  return call_now_text
end

-- A whole number of ms or µs as a command argument (Redis would format a Lua number with
-- %.17g).
local function int(x)
  return string.format('%d', x)
end

-- Numbers of few distinct values (counts, definitions, costs, expiries in ms) are parsed
-- or formatted once, not on every check: inside Redis tonumber costs about 2k instructions
-- and string.format 3.5k. A function library keeps them from call to call; past
-- MAX_REMEMBERED values both tables start again.
local MAX_REMEMBERED = 1024
local parsed, formatted, remembered = {}, {}, 0
-- The text each definition's number came in, by number: a definition is stored as the
-- requests spell it (every daemon writes a number alike), so that the checks that follow
-- find the stored one equal to theirs without parsing it (`load`, `admit_plain`). Started
-- again only between calls (`run`), past MAX_REMEMBERED numbers, so that a definition
-- parsed by a call is spelled when the call stores it.
local spelled, spellings = {}, 0

local function remember()
  if remembered >= MAX_REMEMBERED then
    parsed, formatted, remembered = {}, {}, 0
  end
  remembered = remembered + 1
end

-- tonumber(text), remembered.
local function parse(text)
  local x = parsed[text]
  if x == nil and text then
    x = tonumber(text)
    remember()
    parsed[text] = x
  end
  return x
end

-- A request's capacity or refill (finite, > 0) parsed, its text remembered as its spelling.
local function parse_definition(text)
  local x = parse(text)
  if spelled[x] == nil then
    spelled[x], spellings = text, spellings + 1
  end
  return x
end

-- int(x), remembered.
local function int_text(x)
  local text = formatted[x]
  if not text then
    text = int(x)
    remember()
    formatted[x] = text
  end
  return text
end

local function clock()
  local time = call('TIME')
  return tonumber(time[1]) * 1000000 + tonumber(time[2])
end

-- The answer of a call past its deadline: it did nothing.
local function late_error(now)
  return redis.error_reply('LATE ' .. int(now))
end

-- µs to accrue `tokens` at `r` per second; less a millionth of a µs, so float noise cannot
-- add a whole one.
local function accrual(tokens, r)
  return math.min(math.ceil(tokens / r * 1e6 - 1e-6), MAX_WAIT)
end

-- Whether `tokens` cover `cost`, forgiving float noise of a billionth of the cost (relative,
-- as bourse_core's `covers`: P1 holds for tiny limits and costs too).
local function covers(tokens, cost)
  return tokens >= cost - 1e-9 * cost
end

local function delay_ms(from, to)
  return math.max(math.ceil(math.min(to - from, MAX_WAIT) / 1000), 1)
end

-- A check's answer as one line: the result alone when its numbers (the delay in ms, 1 if a
-- pause held it, the bookings found lapsed) are all 0, else "<ms> <paused> <lapsed>
-- <result>" (a result starts with a letter).
local function answer(result, ms, paused, lapsed)
  if ms == 0 and paused == 0 and lapsed == 0 then
    return result
  end
  return string.format('%d %d %d %s', ms, paused, lapsed, result)
end

-- A stored number, or nil when it is none or not finite: NaN and the infinities, which only
-- another program writes, are refused as malformed (a NaN compares false with everything,
-- so a bucket holding one would admit every check).
local function finite(text)
  local x = tonumber(text)
  if x and x == x and x > -math.huge and x < math.huge then
    return x
  end
end

-- A stored definition's number: finite and > 0, or nil.
local function positive(text)
  local x = finite(text)
  return x and x > 0 and x or nil
end

-- The number a bucket's `k` or `q` field (written with its `t`, read as `t_text`) holds
-- (and its text), or nil once `t` was written again.
local function written_with(field, t_text)
  local space = field and string.find(field, ' ', 1, true)
  if space and string.sub(field, 1, space - 1) == t_text then
    local text = string.sub(field, space + 1)
    return tonumber(text), text
  end
end

-- A bucket's fields as `load` reads them: c, r, b, t, k, q, s, n and, with a booking id,
-- that booking's field, in one HMGET.
local function read_bucket(key, id)
  return id and call('HMGET', key, 'c', 'r', 'b', 't', 'k', 'q', 's', 'n', 'w:' .. id)
    or call('HMGET', key, 'c', 'r', 'b', 't', 'k', 'q', 's', 'n')
end

-- A stored bucket, or nil. A clock that stepped back is treated as "no time passed since
-- the last payment": the bucket refills nothing until the clock passes it again. With a
-- booking id, also that booking's field (or nil). A definition stored as the `request`'s
-- arguments spell it is the request's (not parsed again). `expiry` is set while `k` holds
-- (see the layout): the bucket then has no bookings; `refunds_at_most` while `q` holds.
-- `n_text`: its definition time `n` as stored. `read`: the bucket's fields if already read
-- (`read_bucket`).
local function load(key, now, id, request, read)
  local v = read or read_bucket(key, id)
  if not v[3] then
    return nil, v[9] or nil
  end
  local c, r
  if request and v[1] == request.c_text and v[2] == request.r_text then
    c, r = request.c, request.r
  else
    c, r = positive(v[1]), positive(v[2])
    if (v[1] and not c) or (v[2] and not r) then
      error('malformed bucket')
    end
  end
  local b, t = finite(v[3]), finite(v[4])
  if not (b and t) then
    error('malformed bucket')
  end
  -- Every field a bucket gets is named here, so that its table is sized once.
  local bucket = {
    c = c,
    r = r,
    b = b,
    t = t,
    expiry = nil,
    expiry_read = nil,
    expiry_text = nil,
    refunds_at_most = nil,
    dirty = nil,
    defined = nil,
    shown = nil,
    seen = nil,
    lowered = nil,
    n_text = v[8] or nil,
  }
  bucket.expiry, bucket.expiry_read = written_with(v[5], v[4])
  bucket.refunds_at_most = written_with(v[6], v[4])
  if bucket.t > now then
    bucket.lowered = bucket.t
    bucket.t = now
    bucket.dirty = true
  end
  bucket.seen = v[7] and true
  return bucket, v[9] or nil
end

-- Writes the bucket in one HSET: its tokens, its definition when `defined` (new or
-- changed; its time `n` then kept in `n_text` too), a new key's shown fingerprint, `k`: the expiry `save_unbooked` set or kept,
-- else nothing (a later check reads the bookings and the expiry again), and `q`: what its
-- bookings give back at most, if known.
local function save(key, bucket)
  local b, t = fmt(bucket.b), fmt_time(bucket.t)
  local k = bucket.expiry_text and t .. ' ' .. bucket.expiry_text or ''
  local q = bucket.refunds_at_most and t .. ' ' .. fmt(bucket.refunds_at_most) or ''
  bucket.expiry, bucket.expiry_read, bucket.expiry_text = nil, nil, nil
  local shown = bucket.shown ~= '' and bucket.shown or nil
  bucket.shown = nil
  if bucket.defined then
    bucket.defined = nil
    local c, r = spelled[bucket.c] or fmt(bucket.c), spelled[bucket.r] or fmt(bucket.r)
    local n = fmt_time(call_now)
    bucket.n_text = n
    if shown then
      call('HSET', key, 'b', b, 't', t, 'k', k, 'q', q, 'c', c, 'r', r, 'n', n, 'f', shown)
    else
      call('HSET', key, 'b', b, 't', t, 'k', k, 'q', q, 'c', c, 'r', r, 'n', n)
    end
  elseif shown then
    call('HSET', key, 'b', b, 't', t, 'k', k, 'q', q, 'f', shown)
  else
    call('HSET', key, 'b', b, 't', t, 'k', k, 'q', q)
  end
  if bucket.lowered then
    call('HSET', key, 'z', fmt_time(bucket.lowered))
    bucket.lowered = nil
  end
end

-- Tokens accrued since the last payment, not capped.
local function accrued(bucket, now)
  return bucket.b + bucket.r * ((now - bucket.t) / 1e6)
end

-- Tokens as cheap traffic sees them (capped); minus the pending debt without a definition.
local function tokens(bucket, now)
  if bucket.c then
    return math.min(accrued(bucket, now), bucket.c)
  end
  return bucket.b
end

local function borrowed(bucket, now)
  if bucket.c then
    return math.max(bucket.c - tokens(bucket, now), 0)
  end
  return -bucket.b
end

-- This node's run_id, read once: a function library keeps it from call to call, and a
-- node's run_id changes only with its process, which loads the library anew.
local run_id
local function node_id()
  run_id = run_id or string.match(call('INFO', 'server'), 'run_id:(%x+)')
  return run_id
end

-- Since when the data of this Redis server (`node`) is whole, by its `record`: the time
-- in it when it names this node; else now (the server restarted, or lost its data with
-- the record), with the record's new value. Every limiter on one server keeps the record
-- (the first check of an exchange new to it writes it if need be), so a marker written
-- since is not older than it.
local function data_since(record, now, node)
  local since, by = string.match(call('GET', record) or '', '^(%d+) (%x+)$')
  if by == node then
    return math.min(tonumber(since), now), nil
  end
  return now, fmt(now) .. ' ' .. node
end

-- When this exchange's state began on this Redis node. The marker holds the time and, once
-- a limiter with assume_busy_at_start (`busy`) has seen it, the node's run_id. A marker
-- written under another run_id lies next to buckets that may lack that node's last
-- payments (a replica that took over after a failover lacks what was not yet replicated;
-- a restarted node lacks what was not yet saved; a slot moved to another master is the
-- safe side): for such a limiter the state began again now. A marker without a run_id
-- (written by other limiters, which only create a missing one) is taken as this node's,
-- from when the server's data is whole if later (`data_since`, on one server, given its
-- `record`: a marker restored from a snapshot predates it); such a limiter names the node
-- in it. No marker: the exchange has no state here, so its state began when the server's
-- data did, or now without a record. Reads only: returns the time, the marker's new value
-- when it is to be written (`write_marker`), and the record's.
local function state_began(marker, now, busy, record)
  local value = call('GET', marker)
  local began, by
  if value then
    began, by = string.match(value, '^(%S+) ?(%S*)$')
    began = tonumber(began)
  end
  local node = (busy or record and not began) and node_id() or nil
  local named = busy and ' ' .. node or ''
  if not began then
    if record then
      local since, rewritten = data_since(record, now, node)
      return since, fmt(since) .. named, rewritten
    end
    return now, fmt(now) .. named
  end
  if not busy or by == node then
    return began, nil
  end
  if by ~= '' then
    return now, fmt(now) .. named
  end
  local rewritten
  if record then
    local since
    since, rewritten = data_since(record, now, node)
    began = math.max(began, since)
  end
  return began, fmt(began) .. named, rewritten
end

-- Writes an exchange's marker (`state_began`), living as `keep_markers` keeps it, so that
-- one written by a check that then fails expires too.
local function write_marker(marker, value)
  call('SET', marker, value, 'PX', int((MARKER_TTL + MARKER_SLACK) / 1000))
end

-- Since when a check assumes the buckets new to it busy: the later of when its exchange's
-- state began (with assume_busy_at_start, `busy`) and its caller's own busy start
-- (`started`); nil for neither.
local function busy_since(began, busy, started)
  if busy and started then
    return math.max(began, started)
  end
  return busy and began or started
end

-- When a bucket new at `from` starts: not before the busy start `since` (`busy_since`; a
-- key seen before it is as new then), nor after now.
local function start_time(from, since, now)
  if since and from < since then
    return math.min(since, now)
  end
  return from
end

-- Tokens a bucket new at `from` starts with: full, or as if it had been empty at `since`
-- (`busy_since`).
local function initial_tokens(c, r, from, since)
  if since then
    return math.min(c, r * (math.max(from - since, 0) / 1e6))
  end
  return c
end

-- With assume_busy_at_start, a bucket last paid before its exchange's state began holds at
-- most what refilled since: as if it had been empty then (a debt is kept).
local function empty_since(bucket, began)
  bucket.b = math.min(bucket.b + bucket.r * ((began - bucket.t) / 1e6), 0)
  bucket.t = began
  bucket.dirty = true
  bucket.lowered = math.max(bucket.lowered or 0, call_now)
end

-- ms from `now` until the bucket would behave as new: refilled to capacity (through any
-- debt), past the delay it answered and its last booking's lapse (also returned, if any).
local function keep_ms(item, now, delay)
  local bucket = item.bucket
  local ttl = delay
  if bucket.c then
    local fill = bucket.c / bucket.r * 1e6
    ttl = math.max(fill, (bucket.c - accrued(bucket, now)) / bucket.r * 1e6, delay)
  elseif bucket.b < 0 then
    ttl = math.max(DEBT_TTL, delay)
  end
  local last = not item.unbooked and call('ZRANGE', item.wkey, '-1', '-1', 'WITHSCORES')[2]
  if last then
    ttl = math.max(ttl, tonumber(last) - now)
  end
  return math.ceil((math.min(ttl, MAX_WAIT) + MARGIN) / 1000), last
end

-- Keeps the bucket (and its bookings) until it would behave as new (`keep_ms`). A refusal
-- or a claim pays nothing, so it never shortens what an earlier answer told its caller.
local function keep(item, now, delay, unpaid)
  local ms, last = keep_ms(item, now, delay)
  if unpaid then
    ms = math.max(ms, call('PTTL', item.key))
  end
  call('PEXPIRE', item.key, int_text(ms))
  if last then
    call('PEXPIRE', item.wkey, int_text(ms))
  end
  return ms
end

-- ms a bucket paid without bookings is kept beyond what `keep` asks, so that the checks
-- of the next second find it kept long enough and need no PEXPIRE.
local KEEP_AHEAD = 1000
-- ms the expiry recorded in `k` is taken short of the one set: PEXPIRE counts from the
-- script's start, a little before its TIME.
local EXPIRY_SLACK = 100

-- `save` and `keep` for a bucket just paid, without bookings: when its `k` shows it kept
-- long enough, it is only saved; else it is kept KEEP_AHEAD ms longer than needed, and its
-- `k` records until when. Returns the ms it is kept.
local function save_unbooked(item, now)
  local bucket = item.bucket
  local now_ms = math.floor(now / 1000)
  local ms = keep_ms(item, now, 0)
  local expiry = bucket.expiry
  if expiry and expiry >= now_ms + ms then
    bucket.expiry_text = bucket.expiry_read
    save(item.key, bucket)
    return expiry - now_ms
  end
  ms = ms + KEEP_AHEAD
  bucket.expiry_text = int(now_ms + ms - EXPIRY_SLACK)
  save(item.key, bucket)
  call('PEXPIRE', item.key, int_text(ms))
  return ms
end

-- Keeps each exchange's marker at least a day past this check, and past its longest-lived
-- bucket; set MARKER_SLACK longer than that, so most calls need not renew it.
local function keep_markers(markers)
  for marker, ms in pairs(markers) do
    local want = math.max(ms, MARKER_TTL / 1000)
    local left = call('PTTL', marker)
    if left ~= -2 and left < want then
      call('PEXPIRE', marker, int(want + MARKER_SLACK / 1000))
    end
  end
end

-- Whether the item's bucket behaves under its definition as a new one does but for what
-- accrued beyond the capacity: full, holding no booking (but lapsed ones), last paid longer
-- ago than its fill time; what refusals told their callers plays no part
-- (bourse_core's Bucket::as_new).
local function as_new(item, bucket, now)
  return now - bucket.t > accrual(bucket.c, bucket.r)
    and covers(tokens(bucket, now), bucket.c)
    and (item.unbooked or call('ZCOUNT', item.wkey, fmt(now), '+inf') == 0)
end

-- The uncapped tokens for a request under definition (c, r): a changed definition starts
-- from the current tokens clamped to the new capacity, unless the bucket was as new
-- (`decide` gave it the new one first).
local function start_under(bucket, c, r, now)
  if bucket.c == c and bucket.r == r then
    return accrued(bucket, now)
  end
  return math.min(tokens(bucket, now), c)
end

-- When `cost` can be paid; over-capacity costs may use all that accrued since the last
-- payment, up to the cost.
local function ready_at(item, now)
  local available = math.min(item.start, math.max(item.c, item.cost))
  if covers(available, item.cost) then
    return now
  end
  return now + accrual(item.cost - available, item.r)
end

-- The bucket's bookings: id, ready time, lapse, cost (and its text), slack and refund of
-- each. A booking is stored as "<ready_at> <cost> <booked_at> <refund>"; a booking stored
-- without its refund gives back its whole cost, as before the field existed, and so does
-- one stored without booked_at (then taken as its ready time).
local function bookings_of(item)
  local lapses = call('ZRANGE', item.wkey, '0', '-1', 'WITHSCORES')
  if #lapses == 0 then
    return {}
  end
  local lapse_of = {}
  for j = 1, #lapses, 2 do
    lapse_of[lapses[j]] = tonumber(lapses[j + 1])
  end
  local list = {}
  local fields = call('HGETALL', item.key)
  for j = 1, #fields, 2 do
    local booked = fields[j]:match('^w:(.*)$')
    local ready, cost, at, refund = fields[j + 1]:match('^(%S+) (%S+) ?(%S*) ?(%S*)$')
    ready = tonumber(ready)
    if booked and lapse_of[booked] and ready then
      list[#list + 1] = {
        id = booked,
        ready = ready,
        lapse = lapse_of[booked],
        booked_at = tonumber(at) or ready,
        booked_at_text = at ~= '' and at or fmt(ready),
        cost = tonumber(cost),
        cost_text = cost,
        slack = lapse_of[booked] - ready,
        refund = tonumber(refund) or tonumber(cost),
      }
    end
  end
  return list
end

-- A booking's stored text; its refund only when below its cost.
local function booking_text(b)
  local text = fmt(b.ready) .. ' ' .. b.cost_text .. ' ' .. b.booked_at_text
  if b.refund < b.cost then
    return text .. ' ' .. fmt(b.refund)
  end
  return text
end

-- Bookings in the order they were made.
local function in_booking_order(x, y)
  if x.booked_at ~= y.booked_at then
    return x.booked_at < y.booked_at
  end
  return x.id < y.id
end

-- What the bookings of `list` still held and not lapsed at `now` give back when paid
-- again, together.
local function refunds(list, now)
  local total = 0
  for _, b in ipairs(list) do
    if not b.removed and b.lapse >= now then
      total = total + b.refund
    end
  end
  return total
end

-- Limits what the bookings of `list` give back to `room` together, those not yet due
-- first, then those due, first made first (bourse_core's Bucket::limit_refunds).
-- Returns the bookings it limited.
local function limit_refunds(list, now, room)
  local limited = {}
  if refunds(list, now) <= room then
    return limited
  end
  local held = {}
  for _, b in ipairs(list) do
    if not b.removed and b.lapse >= now then
      held[#held + 1] = b
    end
  end
  table.sort(held, function(x, y)
    if (x.ready <= now) ~= (y.ready <= now) then
      return x.ready > now
    end
    return in_booking_order(x, y)
  end)
  local left = math.max(room, 0)
  for _, b in ipairs(held) do
    local refund = math.min(b.refund, left)
    if refund ~= b.refund then
      b.refund = refund
      limited[#limited + 1] = b
    end
    left = left - refund
  end
  return limited
end

-- Stores the refunds of `limited` bookings still held, in one HSET.
local function store_refunds(item, limited)
  local fields = {}
  for _, b in ipairs(limited) do
    if not b.removed then
      fields[#fields + 1] = 'w:' .. b.id
      fields[#fields + 1] = booking_text(b)
    end
  end
  if #fields > 0 then
    call('HSET', item.key, unpack(fields))
  end
end

-- Records what the bookings of `list` give back together now, for `q`.
local function know_refunds(item, list, now)
  item.bucket.refunds_at_most = refunds(list, now)
end

-- Limits the refunds of the bucket's bookings to `room` (see `limit_refunds`) and stores
-- those it limited; reads them only when its `q` cannot tell that they fit.
local function limit_stored_refunds(item, now, room)
  local at_most = item.bucket.refunds_at_most
  if at_most and at_most <= room then
    return
  end
  local list = bookings_of(item)
  store_refunds(item, limit_refunds(list, now, room))
  know_refunds(item, list, now)
end

-- What the refunds of a bucket's other bookings (`others` together) may still give back
-- once `gone` leaves it for good: less what `gone`'s own refund fell short of its cost,
-- and less what they, with it, would hold beyond the cap now (bourse_core's room_without).
local function room_without(bucket, now, others, gone)
  local beyond = math.max(accrued(bucket, now) + gone.refund + others - bucket.c, 0)
  return others - beyond - (gone.cost - gone.refund)
end

-- Marks `gone`, of `list`, removed (claimed, lapsed or replaced): its cost stays paid, and
-- the refunds of the others shrink by what its own fell short of its cost, and by what
-- they, with it, would hold beyond the cap now (bourse_core's Bucket::remove_booking).
-- Returns the bookings it limited; the caller deletes `gone`.
local function remove_booking(item, list, gone, now)
  gone.removed = true
  local others = refunds(list, now)
  return limit_refunds(list, now, room_without(item.bucket, now, others, gone))
end

-- `id`'s booking in `list`, or nil.
local function booking_in(list, id)
  for _, b in ipairs(list) do
    if b.id == id then
      return b
    end
  end
  return nil
end

-- Removes `id`'s booking from the bucket (see `remove_booking`), if it holds it.
local function remove_stored_booking(item, id, now)
  local list = bookings_of(item)
  local gone = booking_in(list, id)
  if gone then
    store_refunds(item, remove_booking(item, list, gone, now))
    know_refunds(item, list, now)
    call('HDEL', item.key, 'w:' .. id)
    call('ZREM', item.wkey, id)
  end
end

-- Takes back `gone`, of `list` (the bookings of `item`, its bucket loaded and defined),
-- whose caller will not claim it (told Redis was unavailable, or another of its buckets was
-- reset): the bucket gets what its refund gives, and the others' refunds keep only the
-- room left below the cap (bourse_core's Bucket::give_back_booking). Only the latest
-- booking the bucket holds (one made at the same instant counts as later): a later one was
-- paid as of its own ready time, forfeiting what the cap would take until then, part of
-- which the refund would hand out again. A lapsed one only while nothing wrote the bucket
-- since it lapsed (its `t` and `z` no later). Returns whether it was taken back; if not, it
-- stays paid. The caller saves the bucket.
local function give_back_held(item, list, gone, now)
  local bucket = item.bucket
  for _, b in ipairs(list) do
    if b ~= gone and not b.removed and b.booked_at >= gone.booked_at then
      return false
    end
  end
  if gone.lapse < now then
    local lowered = tonumber(call('HGET', item.key, 'z')) or 0
    if bucket.t > gone.lapse or lowered > gone.lapse then
      return false
    end
  end
  gone.removed = true
  bucket.b = bucket.b + gone.refund
  bucket.dirty = true
  store_refunds(item, limit_refunds(list, now, bucket.c - accrued(bucket, now)))
  know_refunds(item, list, now)
  call('HDEL', item.key, 'w:' .. gone.id)
  call('ZREM', item.wkey, gone.id)
  return true
end

-- Marks a key without bookings `unbooked` (known for a new key or from its `k`, else read
-- with one ZRANGE), so that neither `drop_lapsed` nor `keep` reads its bookings. A waiter's
-- check reads the bookings key of an unbooked one too (ZCARD), which it may book on: a key
-- of another type there fails the check before it writes anything.
local function find_bookings(item, waits)
  local bucket = item.loaded
  if not bucket or bucket.expiry then
    item.unbooked = true
    if waits then
      call('ZCARD', item.wkey)
    end
  elseif not call('ZRANGE', item.wkey, '-1', '-1')[1] then
    item.unbooked = true
  end
end

-- Drops bookings whose slack ran out (their cost stays paid); the others' refunds shrink as
-- `remove_booking` shrinks them for each, in the order those were made, limited once to
-- the least room of those steps (bourse_core's Bucket::drop_lapsed). Returns how many, and
-- whether `id`'s booking was among them.
local function drop_lapsed(item, now, id)
  if item.unbooked then
    item.bucket.refunds_at_most = 0
    return 0, false
  end
  local gone = call('ZRANGEBYSCORE', item.wkey, '-inf', '(' .. fmt(now))
  if #gone == 0 then
    return 0, false
  end
  local list, lapsed = bookings_of(item), {}
  for _, b in ipairs(list) do
    if b.lapse < now then
      b.removed = true
      lapsed[#lapsed + 1] = b
    end
  end
  if item.bucket.c then
    table.sort(lapsed, in_booking_order)
    local room = refunds(list, now)
    for _, gone in ipairs(lapsed) do
      room = math.min(room, math.max(room_without(item.bucket, now, room, gone), 0))
    end
    store_refunds(item, limit_refunds(list, now, room))
    know_refunds(item, list, now)
  end
  local dropped = false
  for _, lapsed_id in ipairs(gone) do
    call('HDEL', item.key, 'w:' .. lapsed_id)
    dropped = dropped or lapsed_id == id
  end
  call('ZREMRANGEBYSCORE', item.wkey, '-inf', '(' .. fmt(now))
  return #gone, dropped
end

-- Pays as of `at` >= now: the bucket holds what it would hold had the cost been paid at
-- `at`; what would overflow the cap until then is forfeited. Takes the request's
-- definition; a new one clamps the bucket without the bookings as well, whose refunds
-- keep only the room below its capacity.
local function pay(item, now, at)
  local bucket = item.bucket
  local cap = math.max(item.c, item.cost)
  local lead = item.r * ((at - now) / 1e6)
  local changed = bucket.c ~= item.c or bucket.r ~= item.r
  if changed and not item.unbooked then
    limit_stored_refunds(item, now, math.min(bucket.c, item.c) - item.start)
  end
  local after = math.min(math.min(item.start, cap) + lead, cap) - item.cost
  bucket.b = after - lead
  bucket.t = now
  if changed then
    bucket.c, bucket.r, bucket.defined = item.c, item.r, true
    bucket.lowered = math.max(bucket.lowered or 0, now)
  end
end

-- Pays at `now` for good (an admitted check): the cap takes as much from the bucket
-- without the bookings, whose refunds keep only the room it had below the cap
-- (bourse_core's Bucket::spend).
local function spend(item, now)
  local bucket = item.bucket
  if not item.unbooked and bucket.c == item.c and bucket.r == item.r then
    limit_stored_refunds(item, now, math.max(item.c, item.cost) - item.start)
  end
  pay(item, now, now)
end

-- Pays every booking of `list` again in the order they were made, each as of the latest of
-- its `earliest` (when it may go out now, never before its ready time), when the bucket
-- covers it and the booking before it; each keeps its slack (bourse_core's
-- Bucket::replan: the same order on every bucket, so a held booking keeps its turn).
-- Returns the booking of `id` on this bucket as it now is.
local function replan(item, list, now, id, booking)
  local bucket = item.bucket
  for _, b in ipairs(list) do
    bucket.b = bucket.b + b.refund
  end
  table.sort(list, in_booking_order)
  local last = 0
  for _, b in ipairs(list) do
    local start = accrued(bucket, now)
    local cap = math.max(bucket.c, b.cost)
    local ready = math.max(ready_at({ start = start, c = bucket.c, r = bucket.r, cost = b.cost }, now), b.earliest, last)
    last = ready
    local lead = bucket.r * ((ready - now) / 1e6)
    bucket.b = math.min(math.min(start, cap) + lead, cap) - b.cost - lead
    bucket.t = now
    bucket.dirty = true
    b.refund = b.cost
    b.ready = ready
    local text = booking_text(b)
    call('HSET', item.key, 'w:' .. b.id, text)
    call('ZADD', item.wkey, fmt(ready + b.slack), b.id)
    if b.id == id then
      booking = text
    end
  end
  know_refunds(item, list, now)
  return booking
end

-- Bookings due before `held_until` (> now: a pause began after they were made) go out after
-- it instead, in their order, each keeping its slack: their costs are paid again as of
-- their new ready times (the pause's end, or later when the bucket cannot cover them all
-- then), as if booked behind the pause (bourse_core's Bucket::hold_bookings). Every
-- booking is paid again, the held ones and those behind them: a held one paid again after
-- a later one it now goes out with would take tokens that later one already counted on.
-- Marks the pause's end it planned for, so later checks during the pause read one field.
-- Returns the booking of `id` on this bucket as it now is.
local function hold_bookings(item, held_until, now, id, booking)
  local until_text = fmt(held_until)
  if item.unbooked or not item.bucket.c or call('HGET', item.key, 'h') == until_text then
    return booking
  end
  call('HSET', item.key, 'h', until_text)
  local list, any_held = bookings_of(item), false
  for _, b in ipairs(list) do
    b.earliest = math.max(b.ready, held_until)
    any_held = any_held or b.ready < held_until
  end
  if not any_held then
    return booking
  end
  return replan(item, list, now, id, booking)
end

-- Whether every bucket of a check has room for one more booking (bourse_core's
-- MAX_BOOKINGS): a waiter beyond them is refused as over its budget.
local function room_to_book(items)
  for _, item in ipairs(items) do
    if not item.unbooked and call('ZCARD', item.wkey) >= MAX_BOOKINGS then
      return false
    end
  end
  return true
end

-- The ready time of a booking's text.
local function ready_of(booking)
  return tonumber(booking:match('^(%S+)'))
end

-- Holds `id`'s booking on this bucket until at least `held_until` (a pause of the check's other
-- buckets holds it), paid again here as of its new ready time, which it returns
-- (bourse_core's Bucket::hold_booking).
local function hold_booking(item, id, held_until, now)
  local list = bookings_of(item)
  for _, b in ipairs(list) do
    b.earliest = b.id == id and math.max(b.ready, held_until) or b.ready
  end
  item.booking = replan(item, list, now, id, item.booking)
  return ready_of(item.booking)
end

-- Rounds of holding one claim runs at most; a claim left unsettled answers a delay and
-- runs more when the caller comes back.
local HOLD_ROUNDS = 4

-- The caller's booking for this check was found on every bucket: admitted from its ready
-- time, never charged again. Where a pause that began since moved it later on some of its
-- buckets (`hold_bookings`), it is held until then on the others too, paid again there as
-- of its new ready time, which may be later still (bourse_core's engine::claim).
local function claim(items, id, now, booked_ready, pause_until, lapsed)
  local ready = math.max(booked_ready, pause_until)
  local settled = false
  for _ = 1, HOLD_ROUNDS do
    local later
    for _, item in ipairs(items) do
      if ready_of(item.booking) < ready then
        later = math.max(later or ready, hold_booking(item, id, ready, now))
      end
    end
    if not later then
      settled = true
      break
    end
    ready = later
  end
  local claimed = settled and ready <= now
  for _, item in ipairs(items) do
    if claimed then
      remove_stored_booking(item, id, now)
    else
      item.unbooked = nil
      -- Told to come back at `ready`, the caller finds its booking then on every bucket,
      -- also one where the rounds left it due earlier (bourse_core's engine::claim).
      local lapse = tonumber(call('ZSCORE', item.wkey, id))
      if lapse then
        local slack = lapse - ready_of(item.booking)
        if ready + slack > lapse then
          call('ZADD', item.wkey, fmt(ready + slack), id)
        end
      end
    end
    if item.bucket.dirty then
      save(item.key, item.bucket)
    end
    item.kept = keep(item, now, math.max(ready - now, 0), true)
  end
  if claimed then
    return answer('claimed', 0, 0, lapsed)
  end
  return answer('delay', delay_ms(now, ready), pause_until > now and 1 or 0, lapsed)
end

-- checks: several independent checks in one call, run one after another at one `now`,
-- each answered as it would be alone. KEYS = the run marker, then each check's keys;
-- ARGV = 'checks', the marker's lifetime (ms), the count of checks, then per check its
-- deadline (µs, 0 for none), its count of keys and of arguments, and those arguments.
-- A check's keys are per item its bucket and bookings keys, then per exchange group its
-- pauses and marker keys, then on one server P:data; its arguments the booking id,
-- max_wait_ms (0: a probe), slack (µs), assume busy ('1', or '2' with P:data) or not ('0',
-- or '3' with P:data), then a space and the µs since the caller's own busy start if it
-- has one, item count, then per item c, r, cost, group, credential pause field, key
-- pause field, shown fingerprint. Items are distinct keys (the caller
-- coalesced them). Returns {now, answers}: the answers one line per check (see `answer`;
-- 'admitted' goes on with the definition time `n` of each bucket it paid, which names the
-- bucket for a refund), 'late' for a check past its deadline (it did nothing),
-- 'error <message>' for a check that failed in Redis (a key of another type): each check
-- runs under pcall, and fails before it pays (its keys are all read first).
--
-- The run marker makes a call run once, and holds its answers and the time it ran: a
-- call sent again after the connection was lost finds them and answers them unchanged,
-- with that time (what `refunds` gives back is judged from it), even past its deadline
-- (what they admitted is paid). It is written once, at the end: a call that wrote
-- anything runs to its end (Redis neither stops a script that wrote nor refuses its later
-- writes, and each check runs under pcall), so a run always leaves its answers.
local decide

-- The layout of a `checks` call's arguments, which `refunds` repeats: a check's arguments
-- start at ARGV[at + 1] (its booking id; its item count at at + 5), item i's at
-- ARGV[item_at(at, i) + 1] (c, r, cost, group, credential and key pause fields, shown
-- fingerprint).
local ARGS_PER_ITEM = 7
local function item_at(at, i)
  return at + 5 + (i - 1) * ARGS_PER_ITEM
end

-- Where the next check starts: its first key after KEYS[k], its first argument at ARGV[a]
-- (a check's first three arguments are its deadline or answer, its key count and its
-- argument count).
local function next_check(k, a)
  return k + parse(ARGV[a + 1]), a + 3 + parse(ARGV[a + 2])
end

-- Pauses read by this call, by pauses key: `ends`, the end (µs) by field (false: none),
-- holding the whole hash when it has at most MAX_READ_WHOLE fields (`whole`; nearly
-- always: ended pauses are dropped), else the fields read so far. Checks never write
-- pauses, so the checks of one call share what an earlier one read.
local pause_ends
local MAX_READ_WHOLE = 64

-- What this call knows of `pauses`, read whole (HLEN, then HGETALL unless empty) the first
-- time this call asks.
local function pauses_of(pauses)
  local known = pause_ends[pauses]
  if known then
    return known
  end
  known = { ends = {} }
  local size = call('HLEN', pauses)
  if size <= MAX_READ_WHOLE then
    known.whole = true
    if size > 0 then
      local all = call('HGETALL', pauses)
      for j = 1, #all, 2 do
        known.ends[all[j]] = tonumber(all[j + 1]) or false
      end
    end
  end
  pause_ends[pauses] = known
  return known
end

-- The latest end (µs) of the exchange's pause and the item's credential and key pauses,
-- 0 for none; fields of a hash not read whole are read with one HMGET.
local function pause_end(pauses, credential_field, key_field)
  local known = pauses_of(pauses)
  local ends = known.ends
  if not known.whole and (ends.x == nil or ends[credential_field] == nil or ends[key_field] == nil) then
    local read = call('HMGET', pauses, 'x', credential_field, key_field)
    ends.x = tonumber(read[1]) or false
    ends[credential_field] = tonumber(read[2]) or false
    ends[key_field] = tonumber(read[3]) or false
  end
  return math.max(ends.x or 0, ends[credential_field] or 0, ends[key_field] or 0)
end

-- The first line of a failed check's error, at most 200 bytes.
local function error_text(e)
  local text = type(e) == 'table' and e.err or tostring(e)
  return string.sub(string.match(text, '^[^\n]*'), 1, 200)
end

local function checks(now, late)
  local ran = call('GET', KEYS[1])
  if ran then
    local at, text = string.match(ran, '^(%d+) (.*)$')
    return { tonumber(at), text }
  end
  if late then
    return late_error(now)
  end
  local answers, markers = {}, {}
  pause_ends = {}
  local k, a = 1, 4
  for j = 1, tonumber(ARGV[3]) do
    local deadline = tonumber(ARGV[a])
    if deadline > 0 and now > deadline then
      answers[j] = 'late'
    else
      local ok, items, line, marker, kept = pcall(decide, now, k, a + 2)
      if ok then
        if items then
          for _, item in ipairs(items) do
            markers[item.marker] = math.max(markers[item.marker] or 0, item.kept or 0)
          end
        else
          markers[marker] = math.max(markers[marker] or 0, kept)
        end
        answers[j] = line
      else
        answers[j] = 'error ' .. error_text(items)
      end
    end
    k, a = next_check(k, a)
  end
  keep_markers(markers)
  local text = table.concat(answers, '\n')
  call('SET', KEYS[1], int(now) .. ' ' .. text, 'PX', ARGV[2])
  return { now, text }
end

-- The common check, decided without `decide`'s tables: one key, by a daemon without
-- assume_busy_at_start (a caller's own busy start plays no part: the bucket is not new),
-- whose bucket (its fields `read`) holds the request's definition,
-- was paid without bookings (its `k` holds) and covers the cost, not held by a pause.
-- Pays and keeps it as `decide` would (`spend`, `save_unbooked`); returns the answer, the
-- exchange's marker and the ms the bucket is kept. Any other check: nil, having written
-- nothing. `max_wait`: the check's, parsed (0 for a probe).
local function admit_plain(now, k, at, read, max_wait)
  local a = item_at(at, 1)
  local c_text, r_text = ARGV[a + 1], ARGV[a + 2]
  local flag = string.byte(ARGV[at + 4])
  if flag ~= 48 and flag ~= 51 or ARGV[at + 5] ~= '1' or read[9] or read[1] ~= c_text
    or read[2] ~= r_text then
    return nil
  end
  local b, t = finite(read[3]), finite(read[4])
  local expiry, expiry_text = written_with(read[5], read[4])
  if not (b and t and expiry) or t > now then
    return nil
  end
  if max_wait > 0 then
    -- As `find_bookings`: a key of another type fails the check.
    call('ZCARD', KEYS[k + 2])
  end
  local group = parse(ARGV[a + 4])
  local held_until = pause_end(KEYS[k + 1 + 2 * group], ARGV[a + 5], ARGV[a + 6])
  local c, r, cost = parse(c_text), parse(r_text), parse(ARGV[a + 3])
  local cap = math.max(c, cost)
  local available = math.min(b + r * ((now - t) / 1e6), cap)
  if held_until > now or not covers(available, cost) then
    return nil
  end
  local paid = available - cost
  local ttl = math.max(c / r * 1e6, (c - paid) / r * 1e6, 0)
  local ms = math.ceil((math.min(ttl, MAX_WAIT) + MARGIN) / 1000)
  local now_ms, now_text, key = math.floor(now / 1000), fmt_time(now), KEYS[k + 1]
  -- Written as `save_unbooked` tests it, so that an expiry that is not a number renews too.
  local renew = not (expiry >= now_ms + ms)
  if renew then
    ms = ms + KEEP_AHEAD
    expiry_text = int(now_ms + ms - EXPIRY_SLACK)
  end
  local k_text, q_text = now_text .. ' ' .. expiry_text, now_text .. ' 0'
  call('HSET', key, 'b', fmt(paid), 't', now_text, 'k', k_text, 'q', q_text)
  if renew then
    call('PEXPIRE', key, int_text(ms))
  end
  return 'admitted ' .. (read[8] or '-'), KEYS[k + 2 + 2 * group], renew and ms or expiry - now_ms
end

-- One check, its keys from KEYS[k + 1] and its arguments from ARGV[at + 1]. Returns its
-- items and its answer, or false, the answer, the marker and its ms (`admit_plain`).
decide = function(now, k, at)
  local id, max_wait = ARGV[at + 1], parse(ARGV[at + 2])
  local read = read_bucket(KEYS[k + 1], id)
  local line, marker, kept = admit_plain(now, k, at, read, max_wait)
  if line then
    return false, line, marker, kept
  end
  local waits = max_wait > 0
  -- '1' with assume_busy_at_start, else '0'; '2' and '3' alike, on one server, whose
  -- P:data is then the check's last key; then, for a caller with a busy start of its own,
  -- a space and the µs since it.
  local busy_text, n = ARGV[at + 4], parse(ARGV[at + 5])
  local flag = string.byte(busy_text)
  local busy = flag == 49 or flag == 50
  local record = flag >= 50 and KEYS[k + parse(ARGV[at - 1])] or nil
  local started = #busy_text > 2 and now - tonumber(string.sub(busy_text, 3)) or nil
  local items, began, markers, record_value = {}, {}, {}, nil
  local ready, pause_until, lapsed = now, 0, 0
  local claim_ready = 0
  -- First every read that can fail (a key of another type), so that a check that fails
  -- has written nothing.
  for i = 1, n do
    local a = item_at(at, i)
    local group = parse(ARGV[a + 4])
    local marker = KEYS[k + 2 * n + 2 * group]
    -- Every field an item gets is named here, so that its table is sized once.
    local item = {
      key = KEYS[k + 2 * i - 1],
      wkey = KEYS[k + 2 * i],
      c_text = ARGV[a + 1],
      r_text = ARGV[a + 2],
      c = parse_definition(ARGV[a + 1]),
      r = parse_definition(ARGV[a + 2]),
      cost = parse(ARGV[a + 3]),
      shown = ARGV[a + 7],
      group = group,
      marker = marker,
      loaded = nil,
      found = nil,
      held_until = nil,
      bucket = nil,
      unbooked = nil,
      booking = nil,
      start = nil,
      kept = nil,
      undefined = nil,
      redefined = nil,
    }
    item.loaded, item.found = load(item.key, now, id, item, i == 1 and read or nil)
    if (busy or not (item.loaded and item.loaded.c)) and not began[group] then
      local rewritten
      began[group], markers[marker], rewritten = state_began(marker, now, busy, record)
      record_value = record_value or rewritten
    end
    find_bookings(item, waits)
    item.held_until = pause_end(KEYS[k + 2 * n + 2 * group - 1], ARGV[a + 5], ARGV[a + 6])
    items[i] = item
  end
  for marker, value in pairs(markers) do
    write_marker(marker, value)
  end
  if record_value then
    call('SET', record, record_value)
  end
  for _, item in ipairs(items) do
    local bucket, booking, since = item.loaded, item.found, began[item.group]
    if busy and bucket and bucket.c and bucket.t < since then
      empty_since(bucket, since)
    end
    local assumed = busy_since(since, busy, started)
    if not bucket or not bucket.c then
      -- A new key (no bookings: they are fields of its hash), or one without a definition,
      -- takes this one for the check (taken back if it pays nothing): the tokens a new
      -- bucket starts with when a check first saw the key (now if none has), less the debt.
      local from = start_time(bucket and bucket.seen and bucket.t or now, assumed, now)
      local debt_b = bucket and bucket.b or 0
      item.undefined = { b = debt_b, t = from }
      bucket = {
        c = item.c,
        r = item.r,
        b = debt_b + initial_tokens(item.c, item.r, from, assumed),
        t = from,
        dirty = true,
        defined = true,
        shown = item.shown,
      }
    elseif (bucket.c ~= item.c or bucket.r ~= item.r) and as_new(item, bucket, now) then
      -- A bucket as new under another definition takes this one for the check (taken back
      -- if it pays nothing) as a new key would: the tokens a new bucket starts with, from
      -- when it was full again after its last payment (bourse_core's Bucket::starts_new).
      item.redefined = {
        c = bucket.c,
        r = bucket.r,
        b = bucket.b,
        t = bucket.t,
        dirty = bucket.dirty,
        lowered = bucket.lowered,
      }
      local full_at = bucket.t + accrual(math.max(bucket.c - bucket.b, 0), bucket.r)
      bucket.t = start_time(math.min(full_at, now), assumed, now)
      bucket.c, bucket.r = item.c, item.r
      bucket.b = initial_tokens(item.c, item.r, bucket.t, assumed)
      bucket.dirty, bucket.defined = true, true
      bucket.lowered = math.max(bucket.lowered or 0, now)
    end
    item.bucket = bucket
    local dropped, booking_lapsed = drop_lapsed(item, now, id)
    lapsed = lapsed + dropped
    -- A booking's field outlived by its lapse (the bookings key expired) is no booking.
    if booking_lapsed or item.unbooked then
      booking = nil
    end
    local held_until = item.held_until
    if held_until > now then
      booking = hold_bookings(item, held_until, now, id, booking)
    end
    item.booking = booking
    if claim_ready then
      if booking then
        claim_ready = math.max(claim_ready, ready_of(item.booking))
      else
        claim_ready = nil
      end
    end
    pause_until = math.max(pause_until, held_until)
  end
  if claim_ready then
    return items, claim(items, id, now, claim_ready, pause_until, lapsed)
  end
  -- The caller's booking of this check, left on some buckets only (the others were reset
  -- since): given back there where it can be, as its caller never used it, else left paid
  -- (bourse_core's engine::decide); the check pays anew on every bucket.
  for _, item in ipairs(items) do
    if item.booking then
      local list = bookings_of(item)
      local gone = booking_in(list, id)
      if not (gone and give_back_held(item, list, gone, now)) then
        remove_stored_booking(item, id, now)
      end
      item.booking = nil
    end
  end
  -- When could every bucket pay?
  for _, item in ipairs(items) do
    item.start = start_under(item.bucket, item.c, item.r, now)
    ready = math.max(ready, ready_at(item, now))
  end
  local paused = pause_until > ready and 1 or 0
  ready = math.max(ready, pause_until)
  if ready <= now then
    local defined = {}
    for i, item in ipairs(items) do
      spend(item, now)
      if item.unbooked then
        item.kept = save_unbooked(item, now)
      else
        save(item.key, item.bucket)
        item.kept = keep(item, now, 0)
      end
      defined[i] = item.bucket.n_text or '-'
    end
    -- Each bucket's definition time names the bucket it paid, for a refund (`refunds`).
    return items, answer('admitted ' .. table.concat(defined, ' '), 0, 0, lapsed)
  end
  local ms = delay_ms(now, ready)
  local slack = tonumber(ARGV[at + 3])
  if max_wait > 0 and ms <= max_wait and room_to_book(items) then
    for _, item in ipairs(items) do
      pay(item, now, ready)
      local bucket = item.bucket
      bucket.refunds_at_most = bucket.refunds_at_most and bucket.refunds_at_most + item.cost
      save(item.key, bucket)
      call('HSET', item.key, 'w:' .. id, fmt(ready) .. ' ' .. fmt(item.cost) .. ' ' .. fmt(now))
      call('ZADD', item.wkey, fmt(ready + slack), id)
      item.unbooked = nil
      item.kept = keep(item, now, ready - now)
    end
    return items, answer('booked', ms, paused, lapsed)
  end
  -- Refused: nothing paid, no definition given or changed; a key without one records that
  -- a check saw it (its accrual starts then).
  for _, item in ipairs(items) do
    local undefined, redefined = item.undefined, item.redefined
    if redefined then
      local bucket = item.bucket
      bucket.c, bucket.r, bucket.b, bucket.t = redefined.c, redefined.r, redefined.b, redefined.t
      bucket.dirty, bucket.lowered, bucket.defined = redefined.dirty, redefined.lowered, nil
    end
    if undefined then
      item.bucket = undefined
      local b, t = fmt(undefined.b), fmt_time(undefined.t)
      if item.shown ~= '' then
        call('HSET', item.key, 'b', b, 't', t, 's', '1', 'f', item.shown)
      else
        call('HSET', item.key, 'b', b, 't', t, 's', '1')
      end
    elseif item.bucket.dirty then
      save(item.key, item.bucket)
    end
    item.kept = keep(item, now, ready - now, true)
  end
  return items, answer(max_wait > 0 and 'over_budget' or 'delay', ms, paused, lapsed)
end

-- record: KEYS = bucket, bookings; ARGV = 'record', cost, shown fingerprint. Debits without
-- checking; a key without a definition keeps the debt for its first check, and what
-- accrued since a check saw it (so its life is never shortened). Returns 'recorded <now>
-- <n>': the Redis time it ran and the bucket's `n` (written now on a key holding only debt
-- that has none; '-' for a defined bucket without one), which a `refunds` call of the
-- debit names.
local function record(now)
  local item = { key = KEYS[1], wkey = KEYS[2] }
  local cost = tonumber(ARGV[2])
  local bucket = load(item.key, now)
  if not bucket then
    bucket = { b = -cost, t = now, shown = ARGV[3] }
  elseif bucket.c then
    item.bucket = bucket
    limit_stored_refunds(item, now, bucket.c - accrued(bucket, now))
    bucket.b = tokens(bucket, now) - cost
    bucket.t = now
  else
    bucket.b = bucket.b - cost
  end
  item.bucket = bucket
  save(item.key, bucket)
  local n = bucket.n_text
  if not bucket.c and not n then
    n = fmt_time(now)
    call('HSET', item.key, 'n', n)
  end
  keep(item, now, 0, not bucket.c)
  return 'recorded ' .. fmt_time(now) .. ' ' .. (n or '-')
end

-- Whether booking `b`'s waiter may still claim it before `window_end`: not lapsed at `now`,
-- and due before then (bourse_core's Booking::due_before).
local function due_before(b, window_end, now)
  return b.lapse >= now and b.ready < window_end
end

-- Holds the bookings of `list` due before `window_end` beyond `room` together, first made
-- first, until `window_end`: from the first that `room` cannot cover on, they go out after
-- it, in their order, paid again (bourse_core's Bucket::hold_bookings_beyond).
local function hold_bookings_beyond(item, list, room, window_end, now)
  table.sort(list, in_booking_order)
  local left, first_held = math.max(room, 0), nil
  for _, b in ipairs(list) do
    if due_before(b, window_end, now) then
      if not covers(left, b.cost) then
        first_held = b
        break
      end
      left = left - b.cost
    end
  end
  if not first_held then
    return
  end
  for _, b in ipairs(list) do
    local held = not in_booking_order(b, first_held)
    b.earliest = held and math.max(b.ready, window_end) or b.ready
  end
  replan(item, list, now)
end

-- The cost of the bookings of `list` not lapsed at `now` that are due before `window_end`
-- (bourse_core's Bucket::booked_before).
local function booked_before(list, window_end, now)
  local total = 0
  for _, b in ipairs(list) do
    if due_before(b, window_end, now) then
      total = total + b.cost
    end
  end
  return total
end

-- sync: KEYS = bucket, bookings; ARGV = 'sync', allowance, window_left_ms. Lowers the
-- tokens so that they plus the refill until the window ends fit the allowance (a negative
-- one as 0: no debt past the window), less the bookings due by then (paid, not yet sent),
-- those it cannot cover going out once the window ends; never raises them. Returns the
-- tokens taken. Noted in `z` even when it takes nothing: the bucket with a payment given
-- back would have been lowered.
local function sync(now)
  local item = { key = KEYS[1], wkey = KEYS[2] }
  local bucket = load(item.key, now)
  if not bucket or not bucket.c then
    return '0'
  end
  call('HSET', item.key, 'z', fmt_time(now))
  item.bucket = bucket
  local before = tokens(bucket, now)
  local allowance, window_left_ms = tonumber(ARGV[2]), tonumber(ARGV[3])
  local window_end = now + window_left_ms * 1000
  local list = bookings_of(item)
  hold_bookings_beyond(item, list, allowance, window_end, now)
  local booked = booked_before(list, window_end, now)
  local max_tokens = math.max(allowance, 0) - bucket.r * window_left_ms / 1000 - booked
  -- The bucket without the bookings holds at most `max_tokens + booked`.
  limit_stored_refunds(item, now, math.min(bucket.c, max_tokens + booked) - accrued(bucket, now))
  -- Held bookings paid again may have lowered the tokens already.
  if max_tokens < tokens(bucket, now) then
    bucket.b = max_tokens
    bucket.t = now
    bucket.dirty = true
  end
  if bucket.dirty then
    save(item.key, bucket)
    keep(item, now, 0)
  end
  return fmt(before - tokens(bucket, now))
end

-- refunds: gives back what checks of one `checks` call paid, or what one `record` call
-- debited, whose callers were told Redis was unavailable before its answer came
-- (docs/CONTRACT.md, "Stores": such a call never pays). KEYS = each check's keys, as
-- `checks` had them (a debit: its bucket and bookings keys); ARGV = 'refunds', the Redis
-- time (µs) the call ran, a Redis time the clock had passed when this call was sent unless
-- it was set back since (0: unknown), the count of checks, then per check its answer
-- ('booked', or 'admitted' and the definition time `n` of each bucket it paid, as `checks`
-- answered; a debit: 'recorded' and the `n` its `record` answered), its count of keys and
-- of arguments, and those arguments (a debit: its cost). Runs once (see `once`). Returns
-- how many buckets got something back: none when the clock is behind that time (it was
-- set back).
--
-- Never more than each bucket would hold had the check not paid. A booking is taken back
-- as `give_back_booking` takes it back (also for a daemon's `unbook`: the caller who made it
-- was told Redis was unavailable when it came to claim it). An
-- admitted payment is given back in full while no later write moved the bucket's time
-- (its tokens are those the call left it, plus the cost; a later payment at that same
-- time was computed from tokens the cap did not touch); after later payments, less what
-- accrued since it was paid (the most the cap may have taken from the bucket without it,
-- bookings included: none is held, and those gone were due by now). Not at all where the
-- bucket was lowered by other means since (`z`), or holds bookings, or is not the bucket
-- it paid: its definition time `n` is not `defined`, the one the check paid under
-- (redefined, or dropped and made anew, also under a clock set back). `c_text` and
-- `r_text`: the definition the check named (nil for a debit, which names none).
local function give_back_payment(key, wkey, c_text, r_text, cost, defined, paid_at, now)
  local v = call('HMGET', key, 'c', 'r', 'b', 't', 'z', 'n')
  local c, r, b, t = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])
  if not (c and r and b and t) then
    return false
  end
  if c_text and (c ~= tonumber(c_text) or r ~= tonumber(r_text)) then
    return false
  end
  local lowered = tonumber(v[5]) or 0
  if not defined or v[6] ~= defined or t < paid_at or lowered >= paid_at then
    return false
  end
  if call('EXISTS', wkey) == 1 then
    return false
  end
  local back = cost
  if t ~= paid_at then
    -- A clock set back since: how much accrued is unknown.
    if now < t then
      return false
    end
    back = cost - r * ((now - paid_at) / 1e6)
  end
  if back <= 0 then
    return false
  end
  call('HSET', key, 'b', fmt(math.max(b, math.min(b + back, c))))
  return true
end

-- Takes back the booking `id` of the bucket `key` (see `give_back_held`).
local function give_back_booking(key, wkey, id, now)
  local bucket = load(key, now)
  if not bucket or not bucket.c then
    return false
  end
  local item = { key = key, wkey = wkey, bucket = bucket }
  local list = bookings_of(item)
  local gone = booking_in(list, id)
  if not (gone and give_back_held(item, list, gone, now)) then
    return false
  end
  save(key, bucket)
  return true
end

-- Takes back a debit of `cost` made at `paid_at` on the bucket `key` whose `n` was then
-- `defined`: on a defined bucket as `give_back_payment` takes back a payment; on a key
-- holding only debt, the cost off its debt while it still holds only debt under that `n`
-- (not reset and made anew, nor defined, since).
local function give_back_debit(key, wkey, cost, defined, paid_at, now)
  local v = call('HMGET', key, 'c', 'b', 'n')
  if v[1] then
    return give_back_payment(key, wkey, nil, nil, cost, defined, paid_at, now)
  end
  local b = tonumber(v[2])
  if not b or v[3] ~= defined then
    return false
  end
  call('HSET', key, 'b', fmt(math.max(b, math.min(b + cost, 0))))
  return true
end

local function refunds(now)
  local paid_at, passed, given = tonumber(ARGV[2]), tonumber(ARGV[3]), 0
  if now < passed then
    return 0
  end
  local k, a = 0, 5
  for _ = 1, tonumber(ARGV[4]) do
    local result, at = ARGV[a], a + 2
    local defined = string.gmatch(result, ' (%S+)')
    if result:sub(1, 9) == 'recorded ' then
      local cost = tonumber(ARGV[at + 1])
      local done = give_back_debit(KEYS[k + 1], KEYS[k + 2], cost, defined(), paid_at, now)
      given = given + (done and 1 or 0)
    else
      local id, n = ARGV[at + 1], parse(ARGV[at + 5])
      for i = 1, n do
        local key, wkey = KEYS[k + 2 * i - 1], KEYS[k + 2 * i]
        local item = item_at(at, i)
        local done
        if result == 'booked' then
          done = give_back_booking(key, wkey, id, now)
        else
          local cost, c, r = tonumber(ARGV[item + 3]), ARGV[item + 1], ARGV[item + 2]
          done = give_back_payment(key, wkey, c, r, cost, defined(), paid_at, now)
        end
        given = given + (done and 1 or 0)
      end
    end
    k, a = next_check(k, a)
  end
  return given
end

-- borrowed: KEYS = bucket. capacity - tokens (>= 0), the pending debt, or 0 if unknown.
local function get_borrowed(now)
  local bucket = load(KEYS[1], now)
  return fmt(bucket and borrowed(bucket, now) or 0)
end

-- info: KEYS = per key its bucket, bookings and pauses keys; ARGV = 'info', then per key
-- its credential and key pause fields. Per key: false when unknown and not paused, else {c,
-- r, tokens, borrowed, debt, bookings, booked cost, µs to the earliest booking, µs of pause
-- left, shown fingerprint} (strings; '' for none; a pause alone: no definition, zeros).
-- Reads only: lapsed bookings are skipped, not dropped. A key that is not a bucket (of
-- another type, written by something else under the prefix) is shown as unknown.
local function info_row(i, now)
  local key, wkey, pauses = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local bucket = load(key, now)
  local pause_until = 0
  local ends = call('HMGET', pauses, 'x', ARGV[2 * i], ARGV[2 * i + 1])
  for j = 1, 3 do
    if ends[j] then
      pause_until = math.max(pause_until, tonumber(ends[j]))
    end
  end
  local pause_ms = pause_until > now and fmt(pause_until - now) or ''
  if bucket then
    local ids = call('ZRANGEBYSCORE', wkey, fmt(now), '+inf')
    local booked, next_ready = 0, nil
    for _, id in ipairs(ids) do
      local booking = call('HGET', key, 'w:' .. id)
      if booking then
        local ready, cost = booking:match('^(%S+) (%S+)')
        booked = booked + tonumber(cost)
        next_ready = math.min(next_ready or math.huge, tonumber(ready))
      end
    end
    local left = tokens(bucket, now)
    return {
      bucket.c and fmt(bucket.c) or '',
      bucket.r and fmt(bucket.r) or '',
      fmt(left),
      fmt(borrowed(bucket, now)),
      fmt(bucket.c and math.max(-left, 0) or -bucket.b),
      tostring(#ids),
      fmt(booked),
      next_ready and fmt(math.max(next_ready - now, 0)) or '',
      pause_ms,
      call('HGET', key, 'f') or '',
    }
  elseif pause_ms ~= '' then
    return { '', '', '0', '0', '0', '0', '0', '', pause_ms, '' }
  else
    return false
  end
end

local function info(now)
  local rows = {}
  for i = 1, #KEYS / 3 do
    local read, row = pcall(info_row, i, now)
    rows[i] = read and row
  end
  return rows
end

-- Holds `field` of the pauses hash for `ms`. Overlapping pauses keep the later end; ended
-- ones are dropped and the hash expires after its last end.
local function hold(pauses, field, ms, now)
  local ends = now + math.min(ms * 1000, MAX_WAIT)
  local current = tonumber(call('HGET', pauses, field))
  if not current or current < ends then
    call('HSET', pauses, field, fmt(ends))
  end
  local last = now
  local all = call('HGETALL', pauses)
  for i = 1, #all, 2 do
    local value = tonumber(all[i + 1])
    if value < now then
      call('HDEL', pauses, all[i])
    else
      last = math.max(last, value)
    end
  end
  call('PEXPIRE', pauses, math.ceil((last - now + MARGIN) / 1000))
end

-- pause: KEYS = pauses; ARGV = 'pause', field, ms.
local function pause(now)
  hold(KEYS[1], ARGV[2], tonumber(ARGV[3]), now)
  return 'OK'
end

-- The backoff count at `key` and the end of its last pause (µs); 0 and 0 for none.
local function backoff_at(key)
  local count, held = string.match(call('GET', key) or '', '^(%d+) ?(%d*)$')
  return tonumber(count) or 0, tonumber(held) or 0
end

-- back_off: KEYS = pauses, the backoff counted (the credential's; the exchange's when the
-- field is the exchange's); ARGV = 'back_off', pause field, first ms, longest ms, lapse ms
-- (bourse_core::rules). Holds the field for the first backoff doubled per reply counted
-- before (at most the longest) and counts this one, unless the last backoff's pause still
-- holds: a reply sent before it is held as long again and not counted. The backoff
-- ("<count> <end of its last pause, µs>") lapses after the lapse. Returns the pause in ms.
local function back_off(now)
  local count, held = backoff_at(KEYS[2])
  local counts = held <= now
  local level = counts and count or math.max(count - 1, 0)
  local ms = math.min(tonumber(ARGV[3]) * 2 ^ math.min(level, 30), tonumber(ARGV[4]))
  hold(KEYS[1], ARGV[2], ms, now)
  count = counts and count + 1 or count
  held = math.max(held, now + ms * 1000)
  call('SET', KEYS[2], string.format('%d %s', count, fmt(held)), 'PX', ARGV[5])
  return ms
end

-- reset_backoff: KEYS = the credential's backoff count, the exchange's; ARGV =
-- 'reset_backoff'. Drops each count unless its last pause still holds (the reply's request
-- was sent before that pause).
local function reset_backoff(now)
  for i = 1, 2 do
    local _, held = backoff_at(KEYS[i])
    if held <= now then
      call('DEL', KEYS[i])
    end
  end
  return 'OK'
end

-- data_since: KEYS = P:data. Writes the server's record of since when its data is whole
-- when it names no server or another (`data_since`): a daemon with assume_busy_at_start
-- asks at its start, so that on a server whose data it finds whole its new exchanges
-- count from then.
local function note_data_since(now)
  local _, value = data_since(KEYS[1], now, node_id())
  if value then
    call('SET', KEYS[1], value)
  end
  return 'OK'
end

-- reset: KEYS = bucket, bookings, pauses; ARGV = 'reset', key pause field.
local function reset()
  call('DEL', KEYS[1], KEYS[2])
  call('HDEL', KEYS[3], ARGV[2])
  return 'OK'
end

local ops = {
  checks = checks,
  record = record,
  sync = sync,
  borrowed = get_borrowed,
  info = info,
  pause = pause,
  back_off = back_off,
  reset_backoff = reset_backoff,
  reset = reset,
  refunds = refunds,
  data_since = note_data_since,
}

-- Ops that must not run twice: their calls end their keys with a run marker and their
-- arguments with its lifetime (ms). Sent again after a lost connection, such a call answers
-- what its first run answered, even past its deadline (what it did is done).
local once = { record = true, back_off = true, refunds = true }

local function run_once(op, now, late)
  local marker, lifetime = KEYS[#KEYS], ARGV[#ARGV]
  KEYS[#KEYS], ARGV[#ARGV] = nil, nil
  local ran = call('GET', marker)
  if ran then
    return ran
  end
  if late then
    return late_error(now)
  end
  local answer = op(now)
  call('SET', marker, type(answer) == 'number' and int_text(answer) or answer, 'PX', lifetime)
  return answer
end

-- Runs one call: the entry point, called with the call's keys and arguments (script.rs
-- ends the source with it, as a script or as a function of a library).
local function run(keys, args)
  if not call then
    math, string, table, tonumber, tostring, ipairs, pairs, pcall, type, call = libraries()
  end
  KEYS, ARGV = keys, args
  if spellings >= MAX_REMEMBERED then
    spelled, spellings = {}, 0
  end
  local op = ops[ARGV[1]]
  if not op then
    return redis.error_reply('bourse: unknown script op')
  end
  local deadline = tonumber(ARGV[#ARGV]) or 0
  ARGV[#ARGV] = nil
  local now = clock()
  call_now, call_now_text = now, nil
  local late = deadline > 0 and now > deadline
  if op == checks then
    return checks(now, late)
  end
  if once[ARGV[1]] then
    return run_once(op, now, late)
  end
  if late then
    return late_error(now)
  end
  return op(now)
end
