//! One call of `bucket.lua`: its keys and arguments, sent as `EVALSHA` (the script loaded
//! once with `SCRIPT LOAD`, again on `NOSCRIPT`) or, where a node still lacks it, as `EVAL`.

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
