//! The core types every layer uses: idempotency keys, fingerprints, statuses, outcomes,
//! envelopes, messages and their ordering, errors and their classification, the retry policy,
//! payload limits and the connection slot. Nothing here knows how a delivery is dispatched,
//! run or settled.

pub(crate) mod classify;
pub(crate) mod envelope;
pub(crate) mod error;
pub(crate) mod fingerprint;
pub(crate) mod json_text;
pub(crate) mod key;
pub(crate) mod limit;
pub(crate) mod message;
pub(crate) mod ordering;
pub(crate) mod outcome;
pub(crate) mod policy;
pub(crate) mod slot;
pub(crate) mod status;
pub(crate) mod step_key;

pub use classify::{BoxError, Classify, ErrorClass, Permanent, classify_error_chain};
pub use envelope::{Envelope, SourceMetadata};
pub use error::{
    Conflict, DispatchError, Disposition, Error, HandlerFailure, HookError, RegistryError,
    ReplayError, StoreError, StoreOperation,
};
pub use fingerprint::{Fingerprint, FingerprintError};
pub use key::{IdempotencyKey, KeyError, KeyPart, MAX_KEY_BYTES};
pub use limit::{PayloadLimit, PayloadLimitError};
pub use message::Message;
pub use ordering::{GapPolicy, Ordering, ParkPolicy, ParkTimeout, SequencePart};
pub use outcome::Outcome;
pub use policy::RetryPolicy;
pub use slot::ConnectionSlot;
pub use status::{ClaimMode, Status, UnknownStatus};
pub use step_key::{StepKey, step_key};
