//! The upstream stream, generated deterministically from a seed, and what it must produce
//! downstream.
//!
//! `payments` captured payments (each a distinct event) over `payments / 4` orders of
//! `payments / 40` customers (at least one of each), amounts from 1.00 to 500.00; after each
//! payment, with probability 1/10, a redelivery of one of the 50 payments before it
//! (byte-identical: the payments service's at-least-once delivery). Every random choice comes from
//! `ChaCha8Rng::next_u64` (fixed for a seed across versions), reduced here, not by a library's
//! distribution code.

use std::collections::BTreeMap;

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{Rng as _, SeedableRng as _};
use uuid::Uuid;

use crate::messages::PaymentCaptured;

/// Reproducible random choices built on `ChaCha8Rng::next_u64` alone.
struct Gen(ChaCha8Rng);

impl Gen {
    fn new(seed: u64) -> Self {
        let mut bytes = [0_u8; 32];
        bytes[..8].copy_from_slice(&seed.to_le_bytes());
        Self(ChaCha8Rng::from_seed(bytes))
    }

    /// A number in `0..n` (`n` ≥ 1; the modulo bias is below 2^-40 for the ranges used here).
    fn below(&mut self, n: u64) -> u64 {
        self.0.next_u64() % n
    }

    fn uuid(&mut self) -> Uuid {
        let mut bytes = [0_u8; 16];
        bytes[..8].copy_from_slice(&self.0.next_u64().to_le_bytes());
        bytes[8..].copy_from_slice(&self.0.next_u64().to_le_bytes());
        uuid::Builder::from_random_bytes(bytes).into_uuid()
    }
}

/// What one order must end with downstream.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct OrderTruth {
    pub(crate) customer_id: String,
    pub(crate) payments: i64,
    pub(crate) paid_cents: i64,
}

/// What one customer must end with downstream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CustomerTruth {
    pub(crate) events: i64,
    pub(crate) total_cents: i64,
}

/// The generated stream and its ground truth.
#[derive(Debug)]
pub(crate) struct Stream {
    /// The deliveries, redeliveries included, in order.
    pub(crate) deliveries: Vec<PaymentCaptured>,
    /// Distinct payments.
    pub(crate) payments: usize,
    pub(crate) orders: BTreeMap<String, OrderTruth>,
    pub(crate) customers: BTreeMap<String, CustomerTruth>,
}

impl Stream {
    /// The stream of `payments` payments for `seed`.
    pub(crate) fn generate(payments: usize, seed: u64) -> Self {
        let mut rng = Gen::new(seed);
        let orders = (payments / 4).max(1) as u64;
        let customers = (payments / 40).max(1) as u64;
        // Each order belongs to one customer.
        let owner: Vec<String> = (0..orders)
            .map(|_| format!("cust-{:04}", rng.below(customers)))
            .collect();
        let mut deliveries: Vec<PaymentCaptured> = Vec::with_capacity(payments + payments / 9);
        let mut distinct: Vec<usize> = Vec::with_capacity(payments);
        for _ in 0..payments {
            let order = rng.below(orders) as usize;
            let payment = PaymentCaptured {
                event_id: rng.uuid(),
                order_id: format!("order-{order:05}"),
                customer_id: owner[order].clone(),
                amount_cents: 100 + rng.below(49_901) as i64,
            };
            distinct.push(deliveries.len());
            deliveries.push(payment);
            if rng.below(10) == 0 {
                let back = 1 + rng.below(distinct.len().min(50) as u64) as usize;
                let copy = deliveries[distinct[distinct.len() - back]].clone();
                deliveries.push(copy);
            }
        }
        let mut truth = Stream {
            deliveries: Vec::new(),
            payments,
            orders: BTreeMap::new(),
            customers: BTreeMap::new(),
        };
        for &index in &distinct {
            let payment = &deliveries[index];
            let order = truth.orders.entry(payment.order_id.clone()).or_default();
            order.customer_id.clone_from(&payment.customer_id);
            order.payments += 1;
            order.paid_cents += payment.amount_cents;
            let customer = truth
                .customers
                .entry(payment.customer_id.clone())
                .or_default();
            customer.events += 1;
            customer.total_cents += payment.amount_cents;
        }
        truth.deliveries = deliveries;
        truth
    }

    /// The sum of every distinct payment, in cents.
    pub(crate) fn total_cents(&self) -> i64 {
        self.customers.values().map(|c| c.total_cents).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stream_depends_on_the_seed_only() {
        let a = Stream::generate(400, 7);
        let b = Stream::generate(400, 7);
        assert_eq!(a.deliveries, b.deliveries);
        assert_ne!(a.deliveries, Stream::generate(400, 8).deliveries);
        let distinct: std::collections::BTreeSet<Uuid> =
            a.deliveries.iter().map(|p| p.event_id).collect();
        assert_eq!(distinct.len(), 400);
        assert!(
            a.deliveries.len() > 420,
            "{} deliveries",
            a.deliveries.len()
        );
        assert_eq!(a.orders.values().map(|o| o.payments).sum::<i64>(), 400);
        assert_eq!(a.customers.values().map(|c| c.events).sum::<i64>(), 400);
        assert_eq!(
            a.total_cents(),
            a.orders.values().map(|o| o.paid_cents).sum::<i64>()
        );
    }
}
