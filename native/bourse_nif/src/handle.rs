//! The table as a resource of a type this library opens at load: a call finds its table
//! with one `enif_get_resource` against that type, and borrows it for the call without
//! touching its reference count (rustler's `ResourceArc` looks the type up by `TypeId` on
//! every call and counts a reference in and out, on a cache line every scheduler shares).

use std::ffi::c_void;
use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use bourse_core::Table;
use rustler::sys::{
    enif_alloc_resource, enif_get_resource, enif_make_resource, enif_open_resource_type,
    enif_release_resource, ErlNifEnv, ErlNifResourceFlags, ErlNifResourceType,
};
use rustler::{Decoder, Env, Error, NifResult, Term};

/// The resource type, opened once by [`open_type`].
static TABLE_TYPE: AtomicPtr<ErlNifResourceType> = AtomicPtr::new(ptr::null_mut());

/// A table borrowed from its resource term for the length of one NIF call (the term, an
/// argument of the call, keeps the resource alive until it returns).
pub struct Handle<'a>(pub &'a Table);

// A panic caught at the NIF boundary leaves the table usable: its locks never poison.
impl std::panic::UnwindSafe for Handle<'_> {}

impl Deref for Handle<'_> {
    type Target = Table;

    fn deref(&self) -> &Table {
        self.0
    }
}

/// The resource holds a pointer to the boxed table, so its alignment is the pointer's
/// (the VM aligns resource memory for a pointer, not for every type).
type Slot = *const Table;

unsafe extern "C" fn destructor(_env: *mut ErlNifEnv, slot: *mut c_void) {
    // SAFETY: the VM calls this once, when the last reference is gone, on the memory
    // `new` wrote a pointer from `Box::into_raw` into.
    drop(unsafe { Box::from_raw(*(slot as *mut Slot) as *mut Table) });
}

/// Opens the resource type; called from the library's load callback.
pub fn open_type(env: Env) -> bool {
    // SAFETY: called in the load callback, the only place a resource type may be opened;
    // the name is NUL-terminated and outlives the call.
    let opened = unsafe {
        enif_open_resource_type(
            env.as_c_arg(),
            ptr::null(),
            c"bourse_table".as_ptr(),
            Some(destructor),
            ErlNifResourceFlags::ERL_NIF_RT_CREATE,
            ptr::null_mut(),
        )
    };
    TABLE_TYPE.store(opened as *mut ErlNifResourceType, Ordering::Release);
    !opened.is_null()
}

/// A new resource term owning `table`.
pub fn new(env: Env, table: Table) -> Term {
    let table = Box::into_raw(Box::new(table)) as Slot;
    // SAFETY: the type was opened at load; the memory is written before the term that
    // makes it reachable exists; releasing our reference leaves the term's.
    unsafe {
        let slot = enif_alloc_resource(
            TABLE_TYPE.load(Ordering::Acquire),
            std::mem::size_of::<Slot>(),
        ) as *mut Slot;
        slot.write(table);
        let term = enif_make_resource(env.as_c_arg(), slot as *const c_void);
        enif_release_resource(slot as *const c_void);
        Term::new(env, term)
    }
}

impl<'a> Decoder<'a> for Handle<'a> {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        let mut slot: *const c_void = ptr::null();
        // SAFETY: enif_get_resource only reads `term`, and fills `slot` only for a resource
        // of our type, whose memory `new` initialised with a live table's pointer.
        unsafe {
            let found = enif_get_resource(
                term.get_env().as_c_arg(),
                term.as_c_arg(),
                TABLE_TYPE.load(Ordering::Relaxed),
                &mut slot,
            );
            if found == 0 {
                return Err(Error::BadArg);
            }
            Ok(Handle(&**(slot as *const Slot)))
        }
    }
}
