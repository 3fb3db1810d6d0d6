//! One call of `bucket.lua`: its keys and arguments, sent as `EVALSHA` (the script loaded
//! once with `SCRIPT LOAD`, again on `NOSCRIPT`) or, where a node still lacks it, as `EVAL`.

use std::time::Duration;

use ::redis::{Cmd, Script, ScriptInvocation, ToRedisArgs};

/// The source of the script every call runs.
pub const SOURCE: &str = include_str!("bucket.lua");

/// The keys and arguments of one script call; the first argument names the operation.
#[derive(Default)]
pub struct Call {
    keys: Vec<Vec<u8>>,
    args: Vec<Vec<u8>>,
}

impl Call {
    pub fn key(&mut self, key: impl ToRedisArgs) -> &mut Self {
        self.keys.extend(key.to_redis_args());
        self
    }

    pub fn arg(&mut self, arg: impl ToRedisArgs) -> &mut Self {
        self.args.extend(arg.to_redis_args());
        self
    }

    /// One `checks` call of the checks `parts` (each its keys and arguments, without the
    /// operation), each with its deadline; `marker` makes it run once, for `lifetime`.
    pub fn checks<'a>(
        marker: &[u8],
        lifetime: Duration,
        parts: impl ExactSizeIterator<Item = (u64, &'a Call)>,
    ) -> Self {
        let mut call = Call::default();
        call.key(marker)
            .arg("checks")
            .arg(lifetime.as_millis() as u64)
            .arg(parts.len());
        for (deadline, part) in parts {
            call.arg(deadline).arg(part.keys.len()).arg(part.args.len());
            call.keys.extend(part.keys.iter().cloned());
            call.args.extend(part.args.iter().cloned());
        }
        call
    }

    pub fn key_count(&self) -> usize {
        self.keys.len()
    }

    /// The first key, which names the slot of the call on a cluster.
    pub fn first_key(&self) -> &[u8] {
        self.keys.first().map_or(&[], Vec::as_slice)
    }

    /// The operation and the arguments after it.
    fn split_args(&self) -> (&[u8], &[Vec<u8>]) {
        self.args
            .split_first()
            .map_or((&[][..], &[][..]), |(op, args)| (op.as_slice(), args))
    }

    /// The call as `EVAL` with the script's source, arguments as in [`Self::invocation`]:
    /// it runs, and is cached, on whichever node serves the keys.
    pub fn eval(&self, deadline: u64) -> Cmd {
        let mut command = ::redis::cmd("EVAL");
        command.arg(SOURCE).arg(self.keys.len()).arg(&self.keys);
        let (op, args) = self.split_args();
        command.arg(op).arg(deadline).arg(args);
        command
    }

    /// The invocation, with `deadline` (µs on the Redis clock, 0 for none) after the
    /// operation: bucket.lua reads it first.
    pub fn invocation<'a>(&self, script: &'a Script, deadline: u64) -> ScriptInvocation<'a> {
        let mut invocation = script.prepare_invoke();
        for key in &self.keys {
            invocation.key(key);
        }
        let (op, args) = self.split_args();
        invocation.arg(op).arg(deadline);
        for arg in args {
            invocation.arg(arg);
        }
        invocation
    }
}
