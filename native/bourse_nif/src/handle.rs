//! The library's resources (the table, prepared buckets) as resource types it opens at
//! load: a call finds each with one `enif_get_resource` against its type, and borrows it
//! for the call without touching its reference count (rustler's `ResourceArc` looks the
//! type up by `TypeId` on every call and counts a reference in and out, on a cache line
//! every scheduler shares).

use std::ffi::{c_void, CStr};
use std::ops::Deref;
use std::ptr;
use std::sync::atomic::{AtomicPtr, Ordering};

use bourse_core::{PreparedBucket, Table};
use rustler::sys::{
    enif_alloc_resource, enif_get_resource, enif_make_resource, enif_open_resource_type,
    enif_release_resource, ErlNifEnv, ErlNifResourceFlags, ErlNifResourceType,
};
use rustler::{Decoder, Env, Error, NifResult, Term};

/// A value kept in a resource of its own type.
pub trait Resource: Send + Sync + Sized + 'static {
    /// The resource type's name.
    const NAME: &'static CStr;

    /// Where the type opened at load is kept.
    fn resource_type() -> &'static AtomicPtr<ErlNifResourceType>;
}

impl Resource for Table {
    const NAME: &'static CStr = c"bourse_table";

    fn resource_type() -> &'static AtomicPtr<ErlNifResourceType> {
        static TYPE: AtomicPtr<ErlNifResourceType> = AtomicPtr::new(ptr::null_mut());
        &TYPE
    }
}

impl Resource for PreparedBucket {
    const NAME: &'static CStr = c"bourse_bucket";

    fn resource_type() -> &'static AtomicPtr<ErlNifResourceType> {
        static TYPE: AtomicPtr<ErlNifResourceType> = AtomicPtr::new(ptr::null_mut());
        &TYPE
    }
}

/// A value borrowed from its resource term for the length of one NIF call (the term, an
/// argument of the call, keeps the resource alive until it returns).
pub struct Handle<'a, T = Table>(pub &'a T);

// A panic caught at the NIF boundary leaves the value usable: the table's locks never
// poison, and a prepared bucket is never written after it is made.
impl<T> std::panic::UnwindSafe for Handle<'_, T> {}

impl<T> Deref for Handle<'_, T> {
    type Target = T;

    fn deref(&self) -> &T {
        self.0
    }
}

/// The resource holds a pointer to the boxed value, so its alignment is the pointer's
/// (the VM aligns resource memory for a pointer, not for every type).
type Slot<T> = *const T;

unsafe extern "C" fn destructor<T: Resource>(_env: *mut ErlNifEnv, slot: *mut c_void) {
    // SAFETY: the VM calls this once, when the last reference is gone, on the memory
    // `new` wrote a pointer from `Box::into_raw` into.
    drop(unsafe { Box::from_raw(*(slot as *mut Slot<T>) as *mut T) });
}

/// Opens the resource type of `T`; called from the library's load callback.
pub fn open_type<T: Resource>(env: Env) -> bool {
    // SAFETY: called in the load callback, the only place a resource type may be opened;
    // the name is NUL-terminated and outlives the call.
    let opened = unsafe {
        enif_open_resource_type(
            env.as_c_arg(),
            ptr::null(),
            T::NAME.as_ptr(),
            Some(destructor::<T>),
            ErlNifResourceFlags::ERL_NIF_RT_CREATE,
            ptr::null_mut(),
        )
    };
    T::resource_type().store(opened as *mut ErlNifResourceType, Ordering::Release);
    !opened.is_null()
}

/// A new resource term owning `value`.
pub fn new<T: Resource>(env: Env, value: T) -> Term {
    let value = Box::into_raw(Box::new(value)) as Slot<T>;
    // SAFETY: the type was opened at load; the memory is written before the term that
    // makes it reachable exists; releasing our reference leaves the term's.
    unsafe {
        let slot = enif_alloc_resource(
            T::resource_type().load(Ordering::Acquire),
            std::mem::size_of::<Slot<T>>(),
        ) as *mut Slot<T>;
        slot.write(value);
        let term = enif_make_resource(env.as_c_arg(), slot as *const c_void);
        enif_release_resource(slot as *const c_void);
        Term::new(env, term)
    }
}

impl<'a, T: Resource> Decoder<'a> for Handle<'a, T> {
    fn decode(term: Term<'a>) -> NifResult<Self> {
        let mut slot: *const c_void = ptr::null();
        // SAFETY: enif_get_resource only reads `term`, and fills `slot` only for a resource
        // of `T`'s type, whose memory `new` initialised with a live value's pointer.
        unsafe {
            let found = enif_get_resource(
                term.get_env().as_c_arg(),
                term.as_c_arg(),
                T::resource_type().load(Ordering::Relaxed),
                &mut slot,
            );
            if found == 0 {
                return Err(Error::BadArg);
            }
            Ok(Handle(&**(slot as *const Slot<T>)))
        }
    }
}
