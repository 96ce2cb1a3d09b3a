//! Graceful shutdown on SIGINT and SIGTERM: the token [`Worker::run`] takes.

use tokio_util::sync::CancellationToken;

#[cfg(doc)]
use super::Worker;

/// Resolves on the first SIGINT or SIGTERM (on non-Unix platforms: Ctrl-C).
///
/// # Errors
/// An [`std::io::Error`] if the signal handlers cannot be installed.
pub async fn shutdown_signal() -> std::io::Result<()> {
    let signal = install_signal_handlers()?;
    signal.await;
    Ok(())
}

/// Installs SIGINT and SIGTERM handlers now and returns a token that is cancelled on the first
/// of them (on non-Unix platforms: Ctrl-C). From then on these signals no longer end the process
/// on their own: pass the token to [`Worker::run`] so that it shuts down gracefully.
///
/// Call it early (before connecting to anything) so that a signal during start-up is not lost.
/// Needs a Tokio runtime.
///
/// # Errors
/// An [`std::io::Error`] if the signal handlers cannot be installed.
pub fn cancel_on_signal() -> std::io::Result<CancellationToken> {
    let token = CancellationToken::new();
    let signal = install_signal_handlers()?;
    let cancel = token.clone();
    tokio::spawn(async move {
        signal.await;
        cancel.cancel();
    });
    Ok(token)
}

/// [`cancel_on_signal`] for a worker's `run_until_signal` over the source named `source`: its
/// error as a [`WorkerError`](super::WorkerError) with operation `"install signal handlers"`.
// The error is what `run_until_signal` returns, as large as the report it carries; it happens
// once, before anything runs.
#[allow(clippy::result_large_err)]
pub(crate) fn worker_token(source: &str) -> Result<CancellationToken, super::WorkerError> {
    cancel_on_signal().map_err(|e| super::WorkerError {
        error: crate::source::SourceError::new(source, "install signal handlers", e),
        report: super::WorkerReport {
            stop: super::StopReason::SourceFailed,
            ..super::WorkerReport::default()
        },
    })
}

fn install_signal_handlers() -> std::io::Result<crate::BoxFuture<'static, ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        let mut interrupt = signal(SignalKind::interrupt())?;
        let mut terminate = signal(SignalKind::terminate())?;
        Ok(Box::pin(async move {
            tokio::select! {
                _ = interrupt.recv() => tracing::info!("SIGINT received"),
                _ = terminate.recv() => tracing::info!("SIGTERM received"),
            }
        }))
    }
    #[cfg(not(unix))]
    {
        Ok(Box::pin(async {
            let _ = tokio::signal::ctrl_c().await;
        }))
    }
}
