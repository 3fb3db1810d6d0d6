//! NIF entry points that read their arguments in place: `#[rustler::nif]` collects every
//! call's arguments into a `Vec` (an allocation and a free per call), too dear for the
//! checks, which are the hot path. A call found too long for a normal scheduler continues
//! on a dirty one ([`on_dirty_scheduler`]).

use std::ffi::CStr;
use std::panic::{catch_unwind, AssertUnwindSafe};

use rustler::codegen_runtime::{c_int, NIF_ENV, NIF_TERM};
use rustler::sys::{enif_schedule_nif, ERL_NIF_DIRTY_JOB_CPU_BOUND};
use rustler::{Env, Term};

/// The C entry of a NIF, as the VM calls it.
pub(crate) type RawEntry = unsafe extern "C" fn(NIF_ENV, c_int, *const NIF_TERM) -> NIF_TERM;

/// Registers `$nif: fn(Env, [Term; $arity]) -> Term` as the NIF `$name/$arity` of the
/// library's module, for calls that take shard locks: run on the normal scheduler past
/// the [`crate::gate`], else (a long check holds the locks) continued on a dirty one.
macro_rules! in_place_nif {
    ($name:literal, $arity:literal, $nif:path) => {
        const _: () = {
            fn gated<'a>(
                env: rustler::Env<'a>,
                args: [rustler::Term<'a>; $arity],
            ) -> rustler::Term<'a> {
                match $crate::gate::short() {
                    Some(_past) => $nif(env, args),
                    None => {
                        // SAFETY: NUL-terminated, without another NUL (a NIF's name).
                        let name = unsafe {
                            std::ffi::CStr::from_bytes_with_nul_unchecked(
                                concat!($name, "\0").as_bytes(),
                            )
                        };
                        $crate::entry::on_dirty_scheduler(env, name, dirty, args)
                    }
                }
            }
            $crate::entry::dirty_entry!(dirty, $arity, $nif);
            unsafe extern "C" fn entry(
                env: rustler::codegen_runtime::NIF_ENV,
                argc: rustler::codegen_runtime::c_int,
                argv: *const rustler::codegen_runtime::NIF_TERM,
            ) -> rustler::codegen_runtime::NIF_TERM {
                // SAFETY: the VM calls the entry with `$arity` arguments in `argv`.
                unsafe { $crate::entry::run::<$arity>(env, argc, argv, gated) }
            }
            rustler::codegen_runtime::inventory::submit!(rustler::Nif {
                name: concat!($name, "\0").as_ptr() as *const rustler::codegen_runtime::c_char,
                arity: $arity,
                flags: 0,
                raw_func: entry,
            });
        };
    };
}

pub(crate) use in_place_nif;

/// Defines `$entry`, the C entry that runs `$nif: fn(Env, [Term; $arity]) -> Term` on the
/// arguments it is given: the continuation [`on_dirty_scheduler`] schedules.
macro_rules! dirty_entry {
    ($entry:ident, $arity:literal, $nif:path) => {
        unsafe extern "C" fn $entry(
            env: rustler::codegen_runtime::NIF_ENV,
            argc: rustler::codegen_runtime::c_int,
            argv: *const rustler::codegen_runtime::NIF_TERM,
        ) -> rustler::codegen_runtime::NIF_TERM {
            // SAFETY: `on_dirty_scheduler` schedules it with the `$arity` arguments of a
            // call of the same arity.
            unsafe { $crate::entry::run::<$arity>(env, argc, argv, $nif) }
        }
    };
}

pub(crate) use dirty_entry;

/// Continues the current call on a dirty CPU scheduler: `entry` runs there with the same
/// arguments, and its answer is the call's. Returns the term the current NIF must answer.
pub(crate) fn on_dirty_scheduler<'a, const N: usize>(
    env: Env<'a>,
    name: &CStr,
    entry: RawEntry,
    args: [Term<'a>; N],
) -> Term<'a> {
    let argv: [NIF_TERM; N] = args.map(|term| term.as_c_arg());
    // SAFETY: the arguments are terms of the current call's env, which the VM copies
    // along with the call; the name is NUL-terminated and outlives the call.
    unsafe {
        Term::new(
            env,
            enif_schedule_nif(
                env.as_c_arg(),
                name.as_ptr(),
                ERL_NIF_DIRTY_JOB_CPU_BOUND as c_int,
                entry,
                N as c_int,
                argv.as_ptr(),
            ),
        )
    }
}

/// Calls `nif` with the `N` arguments of a NIF call; a panic raises `badarg` in the
/// caller instead of unwinding into the VM.
///
/// # Safety
/// `env`, `argc` and `argv` are those the VM passed to a NIF of arity `N`.
pub(crate) unsafe fn run<const N: usize>(
    env: NIF_ENV,
    argc: c_int,
    argv: *const NIF_TERM,
    nif: for<'a> fn(Env<'a>, [Term<'a>; N]) -> Term<'a>,
) -> NIF_TERM {
    let lifetime = ();
    // SAFETY: one `Env` for this call, living no longer than it; `argv` holds `argc == N`
    // terms of that env.
    unsafe {
        let env = Env::new(&lifetime, env);
        let args = std::slice::from_raw_parts(argv, argc as usize);
        let terms: [Term; N] = std::array::from_fn(|i| Term::new(env, args[i]));
        match catch_unwind(AssertUnwindSafe(|| nif(env, terms))) {
            Ok(answer) => answer.as_c_arg(),
            Err(_) => rustler::sys::enif_make_badarg(env.as_c_arg()),
        }
    }
}

/// The `badarg` exception, for a NIF whose arguments are not of the types it takes.
pub(crate) fn badarg(env: Env) -> Term {
    // SAFETY: enif_make_badarg only marks the call as raising; the term it returns is
    // the NIF's answer.
    unsafe { Term::new(env, rustler::sys::enif_make_badarg(env.as_c_arg())) }
}
