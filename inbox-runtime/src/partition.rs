//! Partitions: what a message's handlers contend on, so that the [`Worker`](crate::Worker)'s
//! batches in flight never share it.
//!
//! A batch holds every row lock its handlers took until its one commit; two batches that lock
//! the same rows in different orders deadlock. A message type that **declares** the aggregates
//! its handlers lock (an account, an order) lets the Worker form batches so that no two batches
//! in flight share one: they then cannot deadlock on those rows, and run side by side. Declared
//! with `#[message(partition)]` fields (see [`Message::partitions`](crate::Message::partitions));
//! a message's ordering aggregate (`#[message(aggregate)]`) counts as a partition too; or, for
//! every delivery, by a function on the Worker
//! ([`Worker::partition_by`](crate::Worker::partition_by)).

use crate::types::key::KeyPart;

/// The partitions of a message from its `#[message(partition)]` fields' values, in order
/// (duplicates removed), as `#[derive(Message)]` generates [`Message::partitions`]: `None` if
/// any field is null (a `None` of an `Option` field), so that the message counts as undeclared
/// and its batch is run as one that may contend (never as one that cannot).
///
/// Values are compared byte-exactly, as their key parts ([`KeyPart::key_part`]).
///
/// [`Message::partitions`]: crate::Message::partitions
#[doc(hidden)]
pub fn partitions_from(fields: &[&dyn KeyPart]) -> Option<Vec<String>> {
    let mut partitions: Vec<String> = Vec::with_capacity(fields.len());
    for field in fields {
        let value = field.key_part()?.into_owned();
        if !partitions.contains(&value) {
            partitions.push(value);
        }
    }
    Some(partitions)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_in_order_without_repeats() {
        let account = "a-1".to_owned();
        let other = 7_u32;
        assert_eq!(
            partitions_from(&[&account, &other, &"a-1"]),
            Some(vec!["a-1".to_owned(), "7".to_owned()])
        );
        assert_eq!(partitions_from(&[]), Some(vec![]));
    }

    #[test]
    fn a_null_field_is_undeclared() {
        let none: Option<String> = None;
        let some: Option<String> = Some("b".to_owned());
        assert_eq!(partitions_from(&[&"a", &none]), None);
        assert_eq!(
            partitions_from(&[&"a", &some]),
            Some(vec!["a".to_owned(), "b".to_owned()])
        );
        // An empty value is a value (the empty partition), not a null.
        assert_eq!(partitions_from(&[&""]), Some(vec![String::new()]));
    }
}
