//! One call of `bucket.lua`: its keys and arguments, sent as `FCALL` of the function
//! library (Redis >= 7; loaded with `FUNCTION LOAD`, again when missing), as `EVALSHA` (the
//! script loaded once with `SCRIPT LOAD`, again on `NOSCRIPT`) or, where a node still lacks
//! it, as `EVAL`. The command is written straight from the calls' keys and arguments.

use std::io;
use std::ops::Range;
use std::time::Duration;

use ::redis::{Cmd, RedisWrite, ToRedisArgs};

/// The bucket's code; it ends with its entry point, `run(keys, args)`.
const BUCKET: &str = include_str!("bucket.lua");
/// Where the library's text names itself, until its name is known.
const NAME: &str = "@LIBRARY@";

/// `bucket.lua` in its two forms: a script, and a library of one function. Both are named
/// by the code's hash, so daemons of other versions sharing a Redis each run their own.
pub struct Sources {
    /// The script (`EVAL`, `SCRIPT LOAD`): the code, then a call of `run`.
    pub script: String,
    /// The script's SHA1 (`EVALSHA`).
    pub sha: String,
    /// The function's name, also its library's.
    pub function: String,
    /// The name of `run` registered once more as a function that writes nothing, which
    /// Redis runs also when it is out of memory.
    pub read_only: String,
    /// The library (`FUNCTION LOAD`): the code, then `run` registered as both functions.
    pub library: String,
}

impl Sources {
    pub fn new() -> Self {
        // The library is named by the hash of its whole text (its name left out), so a
        // library that registers other functions is another library.
        let template = format!(
            "#!lua name={NAME}\n{BUCKET}\nredis.register_function('{NAME}', run)\n\
             redis.register_function{{function_name='{NAME}_ro', callback=run, \
             flags={{'no-writes'}}}}\n"
        );
        let hash = ::redis::Script::new(&template);
        let function = format!("bourse_{}", &hash.get_hash()[..16]);
        let read_only = format!("{function}_ro");
        let library = template.replace(NAME, &function);
        // `run` is a local of the code, which also names its keys and arguments `KEYS` and
        // `ARGV`: the script's own are taken before.
        let script = format!(
            "local call_keys, call_args = KEYS, ARGV\n{BUCKET}\nreturn run(call_keys, call_args)\n"
        );
        Self {
            sha: ::redis::Script::new(&script).get_hash().to_string(),
            script,
            function,
            read_only,
            library,
        }
    }
}

/// The keys and arguments of one script call; the first argument names the operation.
/// Each is a range of one buffer, so that a call is built without an allocation per part.
#[derive(Default)]
pub struct Call {
    data: Vec<u8>,
    keys: Vec<Range<usize>>,
    args: Vec<Range<usize>>,
    read_only: bool,
}

/// Appends parts to a call's buffer, each recorded as one range of `parts`.
struct Parts<'a> {
    data: &'a mut Vec<u8>,
    parts: &'a mut Vec<Range<usize>>,
}

impl Parts<'_> {
    fn push(&mut self, write: impl FnOnce(&mut Vec<u8>)) {
        let start = self.data.len();
        write(self.data);
        self.parts.push(start..self.data.len());
    }
}

impl RedisWrite for Parts<'_> {
    fn write_arg(&mut self, arg: &[u8]) {
        self.push(|data| data.extend_from_slice(arg));
    }

    fn writer_for_next_arg(&mut self) -> impl io::Write + '_ {
        /// Records the part when dropped, once written.
        struct Part<'a, 'b>(&'a mut Parts<'b>, usize);
        impl Drop for Part<'_, '_> {
            fn drop(&mut self) {
                let end = self.0.data.len();
                self.0.parts.push(self.1..end);
            }
        }
        impl io::Write for Part<'_, '_> {
            fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
                self.0.data.extend_from_slice(buf);
                Ok(buf.len())
            }

            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        let start = self.data.len();
        Part(self, start)
    }
}

/// How a command names the code it runs: a function (`FCALL`), the script by its SHA1
/// (`EVALSHA`) or the script's source (`EVAL`), which runs it on whichever node serves the
/// keys and caches it there.
#[derive(Clone, Copy)]
pub enum Script<'a> {
    Function(&'a str),
    Sha(&'a str),
    Source(&'a str),
}

impl Script<'_> {
    /// The command's start: `FCALL function`, `EVALSHA sha` or `EVAL source`, then the
    /// count of keys.
    fn command(self, keys: usize, args: usize, bytes: usize) -> Cmd {
        let (name, script) = match self {
            Script::Function(name) => ("FCALL", name),
            Script::Sha(sha) => ("EVALSHA", sha),
            Script::Source(source) => ("EVAL", source),
        };
        let mut command = Cmd::with_capacity(3 + keys + args, bytes + script.len() + 16);
        command.arg(name).arg(script).arg(keys);
        command
    }
}

impl Call {
    /// A call of an operation that only reads (`borrowed`, `info`): it calls the function
    /// that writes nothing, so that a Redis out of memory still answers it. (With `FCALL`,
    /// not `FCALL_RO`: a cluster client may send a read-only command to a replica, which
    /// may lag.)
    pub fn read_only() -> Self {
        Self {
            read_only: true,
            ..Self::default()
        }
    }

    /// An empty call with room for `keys` keys and `args` arguments, `bytes` in all.
    pub fn with_capacity(keys: usize, args: usize, bytes: usize) -> Self {
        Self {
            data: Vec::with_capacity(bytes),
            keys: Vec::with_capacity(keys),
            args: Vec::with_capacity(args),
            read_only: false,
        }
    }

    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn keys(&mut self) -> Parts<'_> {
        Parts {
            data: &mut self.data,
            parts: &mut self.keys,
        }
    }

    fn args(&mut self) -> Parts<'_> {
        Parts {
            data: &mut self.data,
            parts: &mut self.args,
        }
    }

    pub fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        key.write_redis_args(&mut self.keys());
        self
    }

    /// Appends a key that `write` writes.
    pub fn key_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> &mut Self {
        self.keys().push(write);
        self
    }

    pub fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        arg.write_redis_args(&mut self.args());
        self
    }

    /// Appends an argument that `write` writes.
    pub fn arg_with(&mut self, write: impl FnOnce(&mut Vec<u8>)) -> &mut Self {
        self.args().push(write);
        self
    }

    /// Appends a number: an integral one as its digits, as bucket.lua stores it (so the
    /// script finds a stored definition equal to the request's without parsing it), any
    /// other in Rust's shortest form that reads back exactly.
    pub fn number(&mut self, x: f64) -> &mut Self {
        if x.fract() == 0.0 && x.abs() < 9.0e15 {
            self.arg(x as i64)
        } else {
            self.arg(x)
        }
    }

    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The last key: a call's run marker, once it has one (`Runs::once`).
    pub fn last_key(&self) -> &[u8] {
        self.keys.last().map_or(&[], |key| &self.data[key.clone()])
    }

    /// The first key, which names the slot of the call on a cluster.
    pub fn first_key(&self) -> &[u8] {
        self.keys.first().map_or(&[], |key| &self.data[key.clone()])
    }

    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    /// Writes `parts` (ranges of this call's buffer) into `command`, one argument each.
    fn write(&self, command: &mut Cmd, parts: &[Range<usize>]) {
        for part in parts {
            command.write_arg(&self.data[part.clone()]);
        }
    }

    /// The call as a command, with `deadline` (µs on the Redis clock, 0 for none) as its
    /// last argument, where bucket.lua takes it off.
    pub fn command(&self, script: Script, deadline: u64) -> Cmd {
        let mut command = script.command(self.keys.len(), self.args.len() + 1, self.bytes());
        self.write(&mut command, &self.keys);
        self.write(&mut command, &self.args);
        command.arg(deadline);
        command
    }
}

/// One `checks` call of the checks `parts` (each its deadline, keys and arguments without
/// the operation), with the call's deadline `latest` last; `marker` makes it run once, for
/// `lifetime` (see bucket.lua).
pub fn checks(
    script: Script,
    marker: &[u8],
    lifetime: Duration,
    latest: u64,
    parts: &[(u64, &Call)],
) -> Cmd {
    let keys = 1 + parts.iter().map(|(_, part)| part.keys.len()).sum::<usize>();
    let args = 4 + parts.iter().map(|(_, p)| 3 + p.args.len()).sum::<usize>();
    let bytes = marker.len() + parts.iter().map(|(_, part)| part.bytes()).sum::<usize>();
    let mut command = script.command(keys, args, bytes + 16 * args);
    command.arg(marker);
    for (_, part) in parts {
        part.write(&mut command, &part.keys);
    }
    command
        .arg("checks")
        .arg(lifetime.as_millis() as u64)
        .arg(parts.len());
    for (deadline, part) in parts {
        command
            .arg(*deadline)
            .arg(part.keys.len())
            .arg(part.args.len());
        part.write(&mut command, &part.args);
    }
    command.arg(latest);
    command
}

/// One `refunds` call: gives back what the checks `paid` (each its answer, `admitted` or
/// `booked`, and its call) paid in a `checks` call that ran at `paid_at` (µs, Redis clock),
/// whose callers stopped waiting before its answer came (see bucket.lua); nothing if the
/// Redis clock is behind `passed` when it runs (a time it had passed when the call was
/// sent, 0 if unknown: it was set back since). It must run once: end it with a run marker.
pub fn refunds(paid_at: u64, passed: u64, paid: &[(&str, &Call)]) -> Call {
    let mut call = Call::default();
    call.arg("refunds").arg(paid_at).arg(passed).arg(paid.len());
    for (result, part) in paid {
        for key in &part.keys {
            call.key_with(|out| out.extend_from_slice(&part.data[key.clone()]));
        }
        call.arg(*result).arg(part.keys.len()).arg(part.args.len());
        for arg in &part.args {
            call.arg_with(|out| out.extend_from_slice(&part.data[arg.clone()]));
        }
    }
    call
}

/// The part of a `refunds` call that gives back what the `record` call `record` debited
/// (see bucket.lua): its bucket and bookings keys, and its cost.
pub fn debit_of(record: &Call) -> Call {
    let mut part = Call::default();
    for key in &record.keys[..2] {
        part.key_with(|out| out.extend_from_slice(&record.data[key.clone()]));
    }
    part.arg_with(|out| out.extend_from_slice(&record.data[record.args[1].clone()]));
    part
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parts written in place make the command that parts given whole make.
    #[test]
    fn calls_are_sent_as_given() {
        let mut call = Call::default();
        call.key(b"k1".to_vec())
            .key_with(|out| out.extend_from_slice(b"k2"))
            .arg("op")
            .arg(1.5)
            .arg_with(|out| out.extend_from_slice(b"a:b"))
            .number(3.0)
            .arg("");
        assert_eq!(call.first_key(), b"k1");
        assert_eq!(call.key_count(), 2);
        let mut expected = ::redis::cmd("FCALL");
        expected.arg("f").arg(2).arg("k1").arg("k2").arg("op");
        expected.arg("1.5").arg("a:b").arg("3").arg("").arg(7);
        let command = call.command(Script::Function("f"), 7);
        assert_eq!(command.get_packed_command(), expected.get_packed_command());
        let mut expected = ::redis::cmd("EVALSHA");
        expected.arg("s").arg(3).arg("m").arg("k1").arg("k2");
        expected.arg("checks").arg(2000).arg(1);
        expected
            .arg(5)
            .arg(2)
            .arg(5)
            .arg("op")
            .arg("1.5")
            .arg("a:b")
            .arg("3")
            .arg("")
            .arg(9);
        let checks = checks(
            Script::Sha("s"),
            b"m",
            Duration::from_secs(2),
            9,
            &[(5, &call)],
        );
        assert_eq!(checks.get_packed_command(), expected.get_packed_command());
    }

    /// A `refunds` call carries each check's keys and arguments as its `checks` call did,
    /// after its answer and counts, and after the two times it is judged by.
    #[test]
    fn refunds_carry_the_checks_as_sent() {
        let mut first = Call::default();
        first.key("b1").key("w1").arg("id").arg(0);
        let mut second = Call::default();
        second.key("b2").key("w2").key("p").arg("id2");
        let refunds = refunds(77, 70, &[("admitted", &first), ("booked", &second)]);
        let mut expected = ::redis::cmd("FCALL");
        expected.arg("f").arg(5).arg("b1").arg("w1");
        expected.arg("b2").arg("w2").arg("p");
        expected.arg("refunds").arg(77).arg(70).arg(2);
        expected.arg("admitted").arg(2).arg(2).arg("id").arg(0);
        expected.arg("booked").arg(3).arg(1).arg("id2").arg(0);
        let command = refunds.command(Script::Function("f"), 0);
        assert_eq!(command.get_packed_command(), expected.get_packed_command());
    }

    /// The script holds as many bookings per bucket as the core.
    #[test]
    fn the_script_holds_the_cores_bookings() {
        let line = format!(
            "local MAX_BOOKINGS = {} -- ",
            bourse_core::rules::MAX_BOOKINGS
        );
        assert!(BUCKET.contains(&line), "bucket.lua lacks {line:?}");
    }

    /// The script keeps a key as long past its last answered delay as the core keeps a
    /// bucket.
    #[test]
    fn the_script_keeps_keys_the_cores_margin() {
        let margin_us = bourse_core::rules::KEEP_MARGIN_MS * 1000;
        let line = format!("local MARGIN = {margin_us} -- ");
        assert!(BUCKET.contains(&line), "bucket.lua lacks {line:?}");
    }
}
