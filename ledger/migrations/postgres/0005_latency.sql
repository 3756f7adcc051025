-- An actor's latency measured apart from its rate (PostgreSQL dialect). Keep in step with
-- ../sqlite/0005_latency.sql.
--
-- `interval_fresh`: the open delivery interval (`busy_since`) began at a claim that ended the
-- actor's idleness and nothing has settled in it yet, so its first delivery holds a round
-- trip besides the work; `latency_s`: that round trip, in seconds, as the hub's transport
-- measures it (NULL until measured); `tokens_per_job`: accepted tokens per job (NULL until
-- measured). The scheduler splits a batch so that every actor finishes together
-- (docs/ledger.md, "Split").
ALTER TABLE actors ADD COLUMN interval_fresh BIGINT NOT NULL DEFAULT 0 CHECK (interval_fresh IN (0, 1));
ALTER TABLE actors ADD COLUMN latency_s DOUBLE PRECISION CHECK (latency_s IS NULL OR latency_s >= 0);
ALTER TABLE actors ADD COLUMN tokens_per_job DOUBLE PRECISION CHECK (tokens_per_job IS NULL OR tokens_per_job >= 0);
