//! Each broker source hands out a payload over its limit cut to the limit, with its real size
//! (`Envelope::cut`), and a payload within it whole: RabbitMQ (AMQP_URL), NATS JetStream
//! (NATS_URL), SQS (SQS_ENDPOINT). Kafka's is checked in `tests/kafka.rs` (bad records).

#![allow(missing_docs)]

use std::time::Duration;

use inbox_runtime::source::{Delivery, Source};
use inbox_runtime::types::PayloadLimit;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run with scripts/test.sh"))
}

fn unique(prefix: &str) -> String {
    format!("{prefix}_{}_{}", std::process::id(), rand_suffix())
}

fn rand_suffix() -> u64 {
    use std::time::{SystemTime, UNIX_EPOCH};
    u64::try_from(
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_nanos()
            % 1_000_000_000,
    )
    .unwrap()
}

/// 10,000 bytes, then 100: the limit is 4096.
const BIG: usize = 10_000;
const SMALL: usize = 100;
const LIMIT: usize = 4096;

fn body(size: usize, fill: u8) -> Vec<u8> {
    vec![fill; size]
}

/// Takes the two deliveries (in any order), checks the big one cut and the small one whole,
/// acks both.
async fn check(source: &mut impl Source) {
    let mut got: Vec<Delivery> = Vec::new();
    for _ in 0..2 {
        let next = tokio::time::timeout(Duration::from_secs(30), source.next()).await;
        got.push(next.expect("a delivery within 30 s").unwrap().unwrap());
    }
    got.sort_by_key(|d| std::cmp::Reverse(d.envelope().payload_size()));
    let (big, small) = (&got[0], &got[1]);
    assert!(big.envelope().is_cut());
    assert_eq!(
        (big.envelope().payload.len(), big.envelope().payload_size()),
        (LIMIT, BIG)
    );
    assert_eq!(big.envelope().payload, body(LIMIT, b'b'));
    assert_eq!(big.envelope().message_name, "bounded.big");
    assert!(!small.envelope().is_cut());
    assert_eq!(small.envelope().payload, body(SMALL, b's'));
    for delivery in got {
        delivery.ack().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn amqp_cuts_at_the_limit() {
    use inbox_runtime::source::amqp::{AmqpConfig, AmqpSource};
    use lapin::options::{BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions};
    use lapin::types::FieldTable;
    use lapin::{BasicProperties, Connection, ConnectionProperties};

    let queue = unique("bounded");
    let connection = Connection::connect(&env("AMQP_URL"), ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_declare(
            queue.as_str().into(),
            QueueDeclareOptions::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for (size, fill) in [(BIG, b'b'), (SMALL, b's')] {
        let properties = BasicProperties::default().with_type("bounded.big".into());
        channel
            .basic_publish(
                "".into(),
                queue.as_str().into(),
                BasicPublishOptions::default(),
                &body(size, fill),
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let mut source = AmqpSource::connect(AmqpConfig::new(env("AMQP_URL"), &queue))
        .await
        .unwrap();
    source.set_payload_limit(PayloadLimit::new(LIMIT).unwrap());
    check(&mut source).await;
    source.close().await.unwrap();
    channel
        .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nats_cuts_at_the_limit() {
    use async_nats::jetstream;
    use inbox_runtime::source::nats::{NatsConfig, NatsSource};

    let name = unique("BOUNDED").to_uppercase();
    let subject = format!("bounded.{}", std::process::id());
    let context = jetstream::new(async_nats::connect(env("NATS_URL")).await.unwrap());
    let _ = context.delete_stream(&name).await;
    context
        .create_stream(jetstream::stream::Config {
            name: name.clone(),
            subjects: vec![format!("{subject}.>")],
            ..Default::default()
        })
        .await
        .unwrap();
    for (size, fill) in [(BIG, b'b'), (SMALL, b's')] {
        context
            .publish(format!("{subject}.bounded.big"), body(size, fill).into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let config =
        NatsConfig::new(env("NATS_URL"), &name, "bounded").subject_prefix(format!("{subject}."));
    let mut source = NatsSource::connect(config).await.unwrap();
    source.set_payload_limit(PayloadLimit::new(LIMIT).unwrap());
    check(&mut source).await;
    source.close().await.unwrap();
    context.delete_stream(&name).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqs_cuts_at_the_limit() {
    use aws_sdk_sqs::types::MessageAttributeValue;
    use inbox_runtime::source::sqs::{AwsSettings, SqsConfig, SqsSource, client};

    let settings = AwsSettings::default().endpoint_url(env("SQS_ENDPOINT"));
    let client = client(&settings, Duration::from_secs(20)).await;
    let name = unique("bounded");
    let url = client
        .create_queue()
        .queue_name(&name)
        .send()
        .await
        .unwrap()
        .queue_url
        .unwrap();
    for (size, fill) in [(BIG, b'b'), (SMALL, b's')] {
        client
            .send_message()
            .queue_url(&url)
            .message_body(String::from_utf8(body(size, fill)).unwrap())
            .message_attributes(
                "message-name",
                MessageAttributeValue::builder()
                    .data_type("String")
                    .string_value("bounded.big")
                    .build()
                    .unwrap(),
            )
            .send()
            .await
            .unwrap();
    }
    let config = SqsConfig::new(&name)
        .aws(settings)
        .wait_time(Duration::from_secs(1));
    let mut source = SqsSource::connect(config).await.unwrap();
    source.set_payload_limit(PayloadLimit::new(LIMIT).unwrap());
    check(&mut source).await;
    source.close().await.unwrap();
    client.delete_queue().queue_url(&url).send().await.unwrap();
}
