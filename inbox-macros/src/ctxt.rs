//! Error collection shared by both macros.
//!
//! Parsing keeps going after the first problem so that one compile reports every mistake in an
//! attribute, each error pointing at its own token.

use proc_macro2::{Span, TokenStream};
use quote::ToTokens;
use std::fmt::Display;

/// Errors gathered while parsing one macro invocation.
#[derive(Default)]
pub(crate) struct Errors {
    errors: Vec<syn::Error>,
}

impl Errors {
    /// Records an error spanned at `span`.
    pub(crate) fn at(&mut self, span: Span, message: impl Display) {
        self.errors.push(syn::Error::new(span, message));
    }

    /// Records an error spanned over all of `tokens`.
    pub(crate) fn spanned(&mut self, tokens: impl ToTokens, message: impl Display) {
        self.errors.push(syn::Error::new_spanned(tokens, message));
    }

    /// Records an error produced elsewhere (for example by a `syn` parser).
    pub(crate) fn push(&mut self, error: syn::Error) {
        self.errors.push(error);
    }

    /// Whether no error has been recorded.
    #[cfg(test)]
    pub(crate) fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }

    /// How many errors have been recorded.
    pub(crate) fn len(&self) -> usize {
        self.errors.len()
    }

    /// `Ok(())` if nothing went wrong, otherwise every recorded error, combined.
    pub(crate) fn finish(self) -> syn::Result<()> {
        let mut errors = self.errors.into_iter();
        match errors.next() {
            None => Ok(()),
            Some(mut first) => {
                first.extend(errors);
                Err(first)
            }
        }
    }
}

/// A `name = value` argument that may be given at most once.
pub(crate) struct Setting<T> {
    name: &'static str,
    given: bool,
    value: Option<T>,
}

impl<T> Setting<T> {
    /// An argument called `name`, not given yet.
    pub(crate) fn new(name: &'static str) -> Self {
        Self {
            name,
            given: false,
            value: None,
        }
    }

    /// Records the argument, with `None` for a value that was already reported as invalid.
    ///
    /// Giving the argument a second time is reported at `tokens` (the repeated name).
    pub(crate) fn set(&mut self, errors: &mut Errors, tokens: impl ToTokens, value: Option<T>) {
        if self.given {
            errors.spanned(tokens, format_args!("`{}` set multiple times", self.name));
        } else {
            self.given = true;
            self.value = value;
        }
    }

    /// Whether the argument was given, valid or not.
    pub(crate) fn is_given(&self) -> bool {
        self.given
    }

    /// The value, if the argument was given.
    pub(crate) fn get(self) -> Option<T> {
        self.value
    }
}

/// The tokens of a macro's output when parsing failed: the errors, plus `fallback` (what the item
/// looks like to its users on success, or the item unchanged, so that one mistake does not
/// cascade into errors everywhere the item is used).
pub(crate) fn error_output(error: &syn::Error, fallback: TokenStream) -> TokenStream {
    let mut output = error.to_compile_error();
    output.extend(fallback);
    output
}
