-- inbox-runtime: lease-owned marks. Each lease writes a fresh token (one per lease, shared by
-- the rows it leases) into the rows it leases; a relay marks a row sent or failed only while
-- the row still carries the token of that relay's lease. A relay that lost its lease (the lease
-- ran out and another relay leased the row again, or an operator retried or discarded it)
-- changes nothing. The token stays on a row marked sent (the lease that sent it) or
-- dead-lettered as abandoned (its last holder may still confirm it); a failed publish and an
-- operator's retry clear it. Rows leased before this migration have none: a relay of this
-- version leases them again once their lease runs out.
ALTER TABLE inbox_outbox ADD COLUMN IF NOT EXISTS lease_token TEXT;
