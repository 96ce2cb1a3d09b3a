#!/usr/bin/env python3
"""The psycopg2 reference consumer of the bench's `peers` section (examples/bench/peers.rs).

A hand-written consumer as the articles on the transactional inbox show it: N threads, each with
its own connection, each taking the next delivery of one shared list and running

    BEGIN;
    INSERT INTO peer_inbox (consumer, key) VALUES (%s, %s) ON CONFLICT DO NOTHING;
    UPDATE peer_accounts SET balance = balance + %s WHERE id = %s;   -- only if a row was inserted
    COMMIT;

The list is the table `peer_deliveries(seq, key, account, amount)` the harness filled, read once
before the clock starts; the threads take deliveries in `seq` order from one shared counter, as
the harness's Rust rows do. The connections are opened before the clock starts too.

    python3 peers_psycopg2.py --workers 4 --consumer peers

Connects with libpq's environment (PGHOST, PGPORT, PGUSER, PGPASSWORD, PGDATABASE). Prints one
JSON object on stdout: {"deliveries": n, "inserted": n, "duplicates": n, "seconds": s}; exits
with status 1 and a message on stderr if a transaction failed.
"""

import argparse
import itertools
import json
import sys
import threading
import time

import psycopg2

INSERT = "INSERT INTO peer_inbox (consumer, key) VALUES (%s, %s) ON CONFLICT DO NOTHING"
EFFECT = "UPDATE peer_accounts SET balance = balance + %s WHERE id = %s"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--consumer", default="peers")
    args = parser.parse_args()

    with psycopg2.connect("") as conn:
        with conn.cursor() as cur:
            cur.execute("SELECT key, account, amount FROM peer_deliveries ORDER BY seq")
            deliveries = cur.fetchall()
    conn.close()

    # One connection per worker, opened before the clock starts. psycopg2 opens a transaction
    # (BEGIN) before the first statement of each: the statements above, one round trip each.
    conns = [psycopg2.connect("") for _ in range(args.workers)]
    counter = itertools.count()  # next() is atomic under the GIL
    start = threading.Barrier(args.workers + 1)
    results = [None] * args.workers

    def work(index):
        conn = conns[index]
        cur = conn.cursor()
        inserted = duplicates = 0
        start.wait()
        try:
            while True:
                i = next(counter)
                if i >= len(deliveries):
                    break
                key, account, amount = deliveries[i]
                cur.execute(INSERT, (args.consumer, key))
                if cur.rowcount == 1:
                    cur.execute(EFFECT, (amount, account))
                    inserted += 1
                else:
                    duplicates += 1
                conn.commit()
            results[index] = (inserted, duplicates, None)
        except Exception as error:  # reported below: the row fails
            results[index] = (inserted, duplicates, repr(error))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(args.workers)]
    for thread in threads:
        thread.start()
    start.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    for conn in conns:
        conn.close()

    errors = [r[2] for r in results if r is None or r[2] is not None]
    if errors:
        print(f"peers_psycopg2: {errors[0]}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "deliveries": len(deliveries),
                "inserted": sum(r[0] for r in results),
                "duplicates": sum(r[1] for r in results),
                "seconds": seconds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
