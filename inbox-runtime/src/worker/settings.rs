//! What both workers, the SQL [`Worker`](super::Worker) and the DynamoDB worker, are
//! configured with beside their dispatcher, and the methods they share: the setters of those
//! settings, the dispatcher's accessor, the parked-message sweep and the run on signals.

use std::time::Duration;

/// The settings both workers share; [`Default`] is what a new worker starts with.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    /// At most this many deliveries (DynamoDB) or transactions (SQL) in flight, at least 1.
    pub(crate) concurrency: usize,
    /// The delay before the redelivery of a failure that names no delay of its own.
    pub(crate) requeue_delay: Duration,
    /// How long running deliveries may take to finish after a shutdown or a source failure;
    /// also the bound on closing the source.
    pub(crate) drain_timeout: Duration,
    /// Stop once nothing was delivered and nothing ran for this long, if set.
    pub(crate) idle: Option<Duration>,
    /// How often the parked-message sweep runs, if at all.
    pub(crate) park_sweep: Option<Duration>,
}

impl Default for Settings {
    /// Concurrency 8, requeue delay 1 s, drain timeout 30 s, no idle stop, the parked-message
    /// sweep every 60 s.
    fn default() -> Self {
        Self {
            concurrency: 8,
            requeue_delay: Duration::from_secs(1),
            drain_timeout: Duration::from_secs(30),
            idle: None,
            park_sweep: Some(Duration::from_secs(60)),
        }
    }
}

/// The methods both workers share, in an `impl` block of a worker with a `settings:`
/// [`Settings`] and a `dispatcher: Arc<…>` field whose dispatcher has `sweep_parked`, and an
/// inherent `run(source, token)`. The caller gives what differs: the dispatcher's type, the
/// links to its `sweep_parked` and to the worker's settlement policy (doc text), and the whole
/// doc of `concurrency` (what it bounds differs). Two steps: [`shared_setters!`] and
/// [`shared_running!`].
macro_rules! shared_methods {
    (
        dispatcher: $dispatcher:ty,
        sweep_parked: $sweep:literal,
        settlement: $settlement:literal,
        $(#[$concurrency:meta])*
        concurrency;
    ) => {
        $crate::worker::settings::shared_setters! {
            sweep_parked: $sweep,
            settlement: $settlement,
            $(#[$concurrency])*
            concurrency;
        }
        $crate::worker::settings::shared_running! { dispatcher: $dispatcher }
    };
}
pub(crate) use shared_methods;

/// The setters of the [`Settings`] (see [`shared_methods!`]).
macro_rules! shared_setters {
    (
        sweep_parked: $sweep:literal,
        settlement: $settlement:literal,
        $(#[$concurrency:meta])*
        concurrency;
    ) => {
        /// How often, while running, the worker calls
        #[doc = $sweep]
        /// (parked messages whose gap stayed open past the dispatcher's
        /// [`ParkPolicy`](crate::types::ParkPolicy) are dead-lettered or released). Default
        /// every 60 s; `None` turns it off. Once the worker's loop has ended (after a
        /// shutdown's drain), no further sweep starts, and `run` returns only when a sweep in
        /// flight has finished; one still running after the
        /// [drain timeout](Self::drain_timeout) is abandoned with a warning (a statement the
        /// database is already running may still complete).
        pub fn park_sweep(mut self, every: Option<std::time::Duration>) -> Self {
            self.settings.park_sweep = every;
            self
        }

        $(#[$concurrency])*
        pub fn concurrency(mut self, n: usize) -> Self {
            self.settings.concurrency = n.max(1);
            self
        }

        /// How long a delivery waits before its redelivery after a failure that names no delay
        #[doc = concat!("of its own (see ", $settlement, "). Default 1 s.")]
        pub fn requeue_delay(mut self, delay: std::time::Duration) -> Self {
            self.settings.requeue_delay = delay;
            self
        }

        /// On shutdown, or after the source failed, how long running deliveries may take to
        /// finish before they are abandoned unsettled; also the bound on
        /// [`Source::close`](crate::source::Source::close) and on a parked-message sweep in
        /// flight (see [`park_sweep`](Self::park_sweep)). Default 30 s.
        pub fn drain_timeout(mut self, timeout: std::time::Duration) -> Self {
            self.settings.drain_timeout = timeout;
            self
        }

        /// Stop (with [`StopReason::Idle`](crate::worker::StopReason::Idle)) once nothing is in
        /// flight and the source has delivered nothing for `idle`: for jobs that drain a queue
        /// and exit.
        pub fn stop_when_idle(mut self, idle: std::time::Duration) -> Self {
            self.settings.idle = Some(idle);
            self
        }
    };
}
pub(crate) use shared_setters;

/// The dispatcher's accessor, the run on signals and the sweep's start (see
/// [`shared_methods!`]).
macro_rules! shared_running {
    (dispatcher: $dispatcher:ty) => {
        /// The dispatcher.
        pub fn dispatcher(&self) -> &$dispatcher {
            &self.dispatcher
        }

        /// Like [`run`](Self::run), shutting down gracefully on SIGINT or SIGTERM (see
        /// [`cancel_on_signal`](crate::worker::cancel_on_signal)).
        ///
        /// # Errors
        /// As [`run`](Self::run); a [`SourceError`](crate::source::SourceError) with operation
        /// `"install signal handlers"` if the handlers cannot be installed.
        pub async fn run_until_signal<S: $crate::source::Source>(
            &self,
            source: S,
        ) -> Result<$crate::worker::WorkerReport, $crate::worker::WorkerError> {
            let token = $crate::worker::signal::worker_token(source.name())?;
            self.run(source, token).await
        }

        /// Starts the parked-message sweep (every [`park_sweep`](Self::park_sweep), if set) on
        /// its own task, to be stopped when the loop has ended.
        fn sweep_parked_beside(&self) -> $crate::worker::sweep::ParkedSweep {
            let dispatcher = self.dispatcher.clone();
            $crate::worker::sweep::ParkedSweep::start(self.settings.park_sweep, move || {
                let dispatcher = dispatcher.clone();
                async move { dispatcher.sweep_parked().await }
            })
        }
    };
}
pub(crate) use shared_running;
