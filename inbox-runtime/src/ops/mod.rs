//! Operations: the admin API ([`admin`]: statistics, dead letters, replay, retention purge),
//! the operator's command line (`cli`, feature `cli`) and the console in the browser
//! (`console`, feature `console`).

pub mod admin;
#[cfg(feature = "cli")]
pub mod cli;
#[cfg(feature = "console")]
pub mod console;
