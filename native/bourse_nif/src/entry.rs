//! NIF entry points that read their arguments in place: `#[rustler::nif]` collects every
//! call's arguments into a `Vec` (an allocation and a free per call), too dear for the
//! checks, which are the hot path.

use std::panic::{catch_unwind, AssertUnwindSafe};

use rustler::codegen_runtime::{c_int, NIF_ENV, NIF_TERM};
use rustler::{Env, Term};

/// Registers `$nif: fn(Env, [Term; $arity]) -> Term` as the NIF `$name/$arity` of the
/// library's module.
macro_rules! in_place_nif {
    ($name:literal, $arity:literal, $nif:path) => {
        const _: () = {
            unsafe extern "C" fn entry(
                env: rustler::codegen_runtime::NIF_ENV,
                argc: rustler::codegen_runtime::c_int,
                argv: *const rustler::codegen_runtime::NIF_TERM,
            ) -> rustler::codegen_runtime::NIF_TERM {
                // SAFETY: the VM calls the entry with `$arity` arguments in `argv`.
                unsafe { $crate::entry::run::<$arity>(env, argc, argv, $nif) }
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
