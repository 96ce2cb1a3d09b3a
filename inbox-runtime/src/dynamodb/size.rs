//! DynamoDB's size accounting, for the clear errors before a call: an item's size by the rules of
//! the DynamoDB Developer Guide ("Item sizes and formats"), and an estimate of a
//! `TransactWriteItems` request's size.

use std::collections::HashMap;

use aws_sdk_dynamodb::types::{AttributeValue, TransactWriteItem};

/// DynamoDB's largest item: 400 KB (409,600 bytes, names and values).
pub(crate) const MAX_ITEM_BYTES: usize = 400 * 1024;
/// DynamoDB's largest `TransactWriteItems` request: 4 MB (4,194,304 bytes).
pub(crate) const MAX_TRANSACTION_BYTES: usize = 4 * 1024 * 1024;
/// DynamoDB's most actions in one `TransactWriteItems`: 100.
pub(crate) const MAX_TRANSACTION_ITEMS: usize = 100;

/// The size of a number as DynamoDB counts it: about one byte per two significant digits, plus
/// one byte.
fn number_size(text: &str) -> usize {
    let digits = text
        .trim_start_matches(['-', '+'])
        .split(['e', 'E'])
        .next()
        .unwrap_or("")
        .chars()
        .filter(char::is_ascii_digit)
        .collect::<String>();
    let significant = digits.trim_start_matches('0').trim_end_matches('0').len();
    significant.div_ceil(2) + 1
}

/// The size of one attribute value, as DynamoDB counts it (strings and binaries by their length;
/// lists and maps 3 bytes plus 1 per element plus their contents; null and Boolean 1 byte).
pub(crate) fn value_size(value: &AttributeValue) -> usize {
    match value {
        AttributeValue::S(text) => text.len(),
        AttributeValue::N(text) => number_size(text),
        AttributeValue::B(blob) => blob.as_ref().len(),
        AttributeValue::Bool(_) | AttributeValue::Null(_) => 1,
        AttributeValue::Ss(set) => set.iter().map(String::len).sum(),
        AttributeValue::Ns(set) => set.iter().map(|n| number_size(n)).sum(),
        AttributeValue::Bs(set) => set.iter().map(|b| b.as_ref().len()).sum(),
        AttributeValue::L(list) => 3 + list.iter().map(|v| 1 + value_size(v)).sum::<usize>(),
        AttributeValue::M(map) => {
            3 + map
                .iter()
                .map(|(k, v)| 1 + k.len() + value_size(v))
                .sum::<usize>()
        }
        // A variant this SDK version does not know: counted as nothing (DynamoDB will say).
        _ => 0,
    }
}

/// The size of an item or a key: its attribute names and values.
pub(crate) fn item_size(item: &HashMap<String, AttributeValue>) -> usize {
    item.iter()
        .map(|(name, value)| name.len() + value_size(value))
        .sum()
}

fn names_size(names: Option<&HashMap<String, String>>) -> usize {
    names.map_or(0, |n| n.iter().map(|(k, v)| k.len() + v.len()).sum())
}

/// An estimate of one action's share of the request: its item or key, its expressions and their
/// names and values. (DynamoDB's own accounting of the 4 MB adds the request's JSON framing,
/// which this leaves out.)
pub(crate) fn action_size(item: &TransactWriteItem) -> usize {
    let mut size = 0;
    if let Some(put) = item.put() {
        size += put.table_name().len() + item_size(put.item());
        size += put.condition_expression().map_or(0, str::len);
        size += names_size(put.expression_attribute_names());
        size += put.expression_attribute_values().map_or(0, item_size);
    }
    if let Some(update) = item.update() {
        size += update.table_name().len() + item_size(update.key());
        size += update.update_expression().len();
        size += update.condition_expression().map_or(0, str::len);
        size += names_size(update.expression_attribute_names());
        size += update.expression_attribute_values().map_or(0, item_size);
    }
    if let Some(delete) = item.delete() {
        size += delete.table_name().len() + item_size(delete.key());
        size += delete.condition_expression().map_or(0, str::len);
        size += names_size(delete.expression_attribute_names());
        size += delete.expression_attribute_values().map_or(0, item_size);
    }
    if let Some(check) = item.condition_check() {
        size += check.table_name().len() + item_size(check.key());
        size += check.condition_expression().len();
        size += names_size(check.expression_attribute_names());
        size += check.expression_attribute_values().map_or(0, item_size);
    }
    size
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_follow_dynamodb_rules() {
        assert_eq!(value_size(&AttributeValue::S("abc".into())), 3);
        assert_eq!(value_size(&AttributeValue::N("12345".into())), 4);
        assert_eq!(value_size(&AttributeValue::N("-1000".into())), 2);
        assert_eq!(value_size(&AttributeValue::Bool(true)), 1);
        assert_eq!(
            value_size(&AttributeValue::L(vec![AttributeValue::S("ab".into())])),
            3 + 1 + 2
        );
        let item = HashMap::from([("pk".to_owned(), AttributeValue::S("k1".into()))]);
        assert_eq!(item_size(&item), 4);
    }
}
