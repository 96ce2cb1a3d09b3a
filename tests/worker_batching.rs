//! The Worker's default batching on every backend: a backlog of ready deliveries commits in
//! batches of exactly the expected sizes (up to `Worker::batch_size`, default 100), a delivery
//! ready alone runs alone on the one-message path, and `Worker::one_per_transaction()` turns
//! batching off. Asserted through the report's `batches`/`batched` counters, the exact effects
//! and the exact outcome counts — never through timing.

#![allow(missing_docs)]

use inbox_runtime::Message;
use serde::{Deserialize, Serialize};

/// A credit of `amount` to the effect `id` (the idempotency key is `id`).
#[derive(Debug, Clone, Serialize, Deserialize, Message)]
#[message(name = "wb.credit")]
pub struct Credit {
    #[message(key)]
    pub id: String,
    pub amount: i64,
}

inbox_tests::backend_matrix! {
    use std::collections::BTreeMap;
    use std::time::Duration;

    use inbox_runtime::source::memory::MemorySource;
    use inbox_runtime::{CancellationToken, Dispatcher, Worker, WorkerReport, handler};
    use inbox_tests::envelope;

    #[inbox_runtime::idempotent(consumer = "wb-credits")]
    async fn credit(conn: &mut Conn, msg: Credit) -> Result<(), sqlx::Error> {
        sqlx::query(APPLY_EFFECT)
            .bind(&msg.id)
            .bind(msg.amount)
            .execute(&mut *conn)
            .await?;
        Ok(())
    }

    /// `events` distinct credits (`c0` … with amount `i + 1`), then the first `redeliveries`
    /// of them again: the messages in order, and the effects they must leave.
    fn workload(
        events: usize,
        redeliveries: usize,
    ) -> (Vec<Credit>, BTreeMap<String, (i64, i64)>) {
        let mut messages: Vec<Credit> = (0..events)
            .map(|i| Credit {
                id: format!("c{i}"),
                amount: i as i64 + 1,
            })
            .collect();
        messages.extend(messages[..redeliveries].to_vec());
        let expected = (0..events)
            .map(|i| (format!("c{i}"), (1, i as i64 + 1)))
            .collect();
        (messages, expected)
    }

    /// Runs `messages`, all ready before the worker starts, through `configure(worker)`.
    async fn run_backlog(
        pool: &Pool,
        messages: &[Credit],
        configure: impl FnOnce(Worker<Db>) -> Worker<Db>,
    ) -> WorkerReport {
        let source = MemorySource::new("backlog");
        let handle = source.handle();
        for message in messages {
            handle.push(envelope(message));
        }
        handle.close();
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(credit)]).unwrap();
        let worker = configure(Worker::new(dispatcher).park_sweep(None));
        worker.run(source, CancellationToken::new()).await.unwrap()
    }

    /// A backlog of 250 ready deliveries (230 keys, 20 redeliveries) at concurrency 1 runs as
    /// batches of 100, 100 and 50: the first fills from the backlog, the second gathers while
    /// the first runs ((concurrency + 1) × 100 fetched), the last takes what is left.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_backlog_commits_in_batches_of_the_default_size() {
        let (pool, _guard) = fixture().await;
        let (messages, expected) = workload(230, 20);
        let report = run_backlog(&pool, &messages, |w| w.concurrency(1)).await;
        assert_eq!((report.batches, report.batched), (3, 250), "{report:?}");
        assert_eq!(
            (report.deliveries, report.processed, report.duplicates, report.acked),
            (250, 230, 20, 250),
            "{report:?}"
        );
        assert_eq!(
            (report.failed, report.requeued, report.rejected, report.abandoned),
            (0, 0, 0, 0),
            "{report:?}"
        );
        assert_eq!(inbox_tests::effects(&pool).await, expected);
    }

    /// `batch_size(n)` bounds each transaction: 250 ready deliveries in batches of 40 are seven
    /// batches (six of 40, one of 10).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn batch_size_bounds_each_transaction() {
        let (pool, _guard) = fixture().await;
        let (messages, expected) = workload(250, 0);
        let report = run_backlog(&pool, &messages, |w| w.concurrency(1).batch_size(40)).await;
        assert_eq!((report.batches, report.batched), (7, 250), "{report:?}");
        assert_eq!((report.processed, report.acked), (250, 250), "{report:?}");
        assert_eq!(inbox_tests::effects(&pool).await, expected);
    }

    /// `one_per_transaction()` (and `batch_size(1)`) run every delivery alone.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn one_per_transaction_runs_no_batch() {
        let (pool, _guard) = fixture().await;
        let (messages, expected) = workload(120, 10);
        let report = run_backlog(&pool, &messages, |w| w.concurrency(4).one_per_transaction()).await;
        assert_eq!((report.batches, report.batched), (0, 0), "{report:?}");
        assert_eq!(
            (report.deliveries, report.processed, report.duplicates, report.acked),
            (130, 120, 10, 130),
            "{report:?}"
        );
        assert_eq!(inbox_tests::effects(&pool).await, expected);

        let (pool, _guard) = fixture().await;
        let report = run_backlog(&pool, &messages, |w| w.concurrency(1).batch_size(1)).await;
        assert_eq!((report.batches, report.batched, report.processed), (0, 0, 120), "{report:?}");
        assert_eq!(inbox_tests::effects(&pool).await, expected);
    }

    /// Deliveries that arrive one at a time (the next pushed after the previous one was
    /// settled) each run alone on the one-message path: no batch, and nothing waits.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_delivery_ready_alone_runs_alone() {
        let (pool, _guard) = fixture().await;
        let (messages, expected) = workload(12, 0);
        let source = MemorySource::new("trickle");
        let handle = source.handle();
        let dispatcher = Dispatcher::from_handlers(pool.clone(), [handler!(credit)]).unwrap();
        let worker = Worker::new(dispatcher).park_sweep(None);
        let running = tokio::spawn(async move {
            worker.run(source, CancellationToken::new()).await.unwrap()
        });
        for (i, message) in messages.iter().enumerate() {
            handle.push(envelope(message));
            // Waits for the settlement (a condition, not a duration: the loop only polls).
            while handle.settlements().len() < i + 1 {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
        }
        handle.close();
        let report = running.await.unwrap();
        assert_eq!((report.batches, report.batched), (0, 0), "{report:?}");
        assert_eq!(
            (report.deliveries, report.processed, report.acked),
            (12, 12, 12),
            "{report:?}"
        );
        assert_eq!(inbox_tests::effects(&pool).await, expected);
    }
}
