//! One call of `bucket.lua`: its keys and arguments, sent as `EVALSHA` (the script loaded
//! once with `SCRIPT LOAD`, again on `NOSCRIPT`) or, where a node still lacks it, as `EVAL`.
//! The command is written straight from the calls' keys and arguments.

use std::time::Duration;

use ::redis::{Cmd, ToRedisArgs};

/// The source of the script every call runs.
pub const SOURCE: &str = include_str!("bucket.lua");

/// The keys and arguments of one script call; the first argument names the operation.
#[derive(Default)]
pub struct Call {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

/// How a command names the script: by its SHA1 (`EVALSHA`) or with its source (`EVAL`),
/// which runs it on whichever node serves the keys and caches it there.
#[derive(Clone, Copy)]
pub enum Script<'a> {
    Sha(&'a str),
    Source,
}

impl Script<'_> {
    /// The command's start: `EVALSHA sha` or `EVAL source`, then the count of keys.
    fn command(self, keys: usize, args: usize, bytes: usize) -> Cmd {
        let (name, script) = match self {
            Script::Sha(sha) => ("EVALSHA", sha),
            Script::Source => ("EVAL", SOURCE),
        };
        let mut command = Cmd::with_capacity(3 + keys + args, bytes + script.len() + 16);
        command.arg(name).arg(script).arg(keys);
        command
    }
}

impl Call {
    pub fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        key.write_redis_args(&mut self.keys);
        self
    }

    pub fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        arg.write_redis_args(&mut self.args);
        self
    }

    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The first key, which names the slot of the call on a cluster.
    pub fn first_key(&self) -> &[u8] {
        self.keys.first().map_or(&[], Vec::as_slice)
    }

    fn bytes(&self) -> usize {
        self.keys.iter().chain(&self.args).map(Vec::len).sum()
    }

    /// The call as a command, with `deadline` (µs on the Redis clock, 0 for none) after the
    /// operation: bucket.lua reads it first.
    pub fn command(&self, script: Script, deadline: u64) -> Cmd {
        let mut command = script.command(self.keys.len(), self.args.len() + 1, self.bytes());
        command.arg(&self.keys);
        if let Some((op, args)) = self.args.split_first() {
            command.arg(op).arg(deadline).arg(args);
        }
        command
    }
}

/// One `checks` call of the checks `parts` (each its deadline, keys and arguments without
/// the operation), with the call's deadline `latest`; `marker` makes it run once, for
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
        command.arg(&part.keys);
    }
    command
        .arg("checks")
        .arg(latest)
        .arg(lifetime.as_millis() as u64)
        .arg(parts.len());
    for (deadline, part) in parts {
        command
            .arg(*deadline)
            .arg(part.keys.len())
            .arg(part.args.len())
            .arg(&part.args);
    }
    command
}
