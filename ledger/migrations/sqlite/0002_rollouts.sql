-- Rollouts on the ledger (SQLite dialect). Keep in step with ../postgres/0002_rollouts.sql.
--
-- batches: the staleness bound judged at acceptance, and cancellation (cancelled jobs become
-- 'failed'; the batch records when).
ALTER TABLE batches ADD COLUMN max_staleness INTEGER NOT NULL DEFAULT 1 CHECK (max_staleness >= 0);
ALTER TABLE batches ADD COLUMN cancelled_at INTEGER;

-- versions: what the hub knows of each version beyond the ledger's needs (delta file, sizes,
-- the trainer's step), as one JSON document written with the row.
ALTER TABLE versions ADD COLUMN meta TEXT NOT NULL DEFAULT '{}';

-- results: their batch, for the trainer's result stream (ordered by result id = cursor).
ALTER TABLE results ADD COLUMN batch_id INTEGER REFERENCES batches (id);
CREATE INDEX results_by_batch ON results (batch_id, id);

-- Refused submissions per batch and reason, counted in the submit transaction.
CREATE TABLE refusals (
    batch_id INTEGER NOT NULL REFERENCES batches (id),
    reason   TEXT    NOT NULL,
    count    INTEGER NOT NULL CHECK (count >= 0),
    PRIMARY KEY (batch_id, reason)
);

-- The run's identity and settings the hub must find again after a restart (model id, the
-- initial checkpoint), as key/value text.
CREATE TABLE run_meta (
    key   TEXT PRIMARY KEY,
    value TEXT NOT NULL
);
