//! Error collection (serde_derive's `Ctxt`): every stage reports into one
//! context instead of stopping at the first mistake, so a declaration with
//! three mistakes gets three errors, each at its own span.

use std::cell::RefCell;
use std::fmt::Display;

use proc_macro2::Span;

/// Collected errors; must be taken with [`Ctxt::check`] before it is dropped.
pub struct Ctxt {
    errors: RefCell<Option<Vec<syn::Error>>>,
}

impl Ctxt {
    /// An empty context.
    pub fn new() -> Self {
        Ctxt {
            errors: RefCell::new(Some(Vec::new())),
        }
    }

    /// Records `msg` at `span`.
    pub fn error(&self, span: Span, msg: impl Display) {
        self.syn_error(syn::Error::new(span, msg));
    }

    /// Records a syn error (a parse error keeps its own span).
    pub fn syn_error(&self, err: syn::Error) {
        if let Some(errors) = self.errors.borrow_mut().as_mut() {
            errors.push(err);
        }
    }

    /// Number of errors so far.
    pub fn count(&self) -> usize {
        self.errors.borrow().as_ref().map_or(0, Vec::len)
    }

    /// All errors combined into one, or `Ok` when there were none.
    pub fn check(self) -> Result<(), syn::Error> {
        let errors = self.errors.borrow_mut().take().unwrap_or_default();
        let mut iter = errors.into_iter();
        let Some(mut first) = iter.next() else {
            return Ok(());
        };
        for e in iter {
            first.combine(e);
        }
        Err(first)
    }
}

impl Drop for Ctxt {
    fn drop(&mut self) {
        // A bug in this crate, never a user error: errors would be lost.
        if !std::thread::panicking() && self.errors.borrow().is_some() {
            panic!("foldmoe-macros: Ctxt dropped without check()");
        }
    }
}
