-- Results, failures, durability of delivery and retention (SQLite dialect). Keep in step with
-- ../postgres/0004_results.sql.
--
-- Monotonic counters that survive row deletion: `result_cursor` is the last cursor handed
-- out (a result becomes readable with the next one, inside the transaction that makes it
-- readable, which holds this row until it commits: cursors become visible in commit order on
-- PostgreSQL too); `jobs` is the number of job rows the ledger holds (status reads it instead
-- of counting every job).
CREATE TABLE ledger_counters (
    name  TEXT    PRIMARY KEY,
    value INTEGER NOT NULL CHECK (value >= 0)
);
INSERT INTO ledger_counters (name, value) VALUES
    ('result_cursor', COALESCE((SELECT MAX(id) FROM results), 0)),
    ('jobs', (SELECT COUNT(*) FROM jobs));

-- results.cursor: the trainer's position in a batch's stream; NULL while the result waits for
-- its reward service (not readable yet). Results accepted before this migration keep their id.
ALTER TABLE results ADD COLUMN cursor INTEGER;
UPDATE results SET cursor = id;
CREATE UNIQUE INDEX results_cursor ON results (cursor);
CREATE INDEX results_readable ON results (batch_id, cursor) WHERE cursor IS NOT NULL;
CREATE INDEX results_unscored ON results (id) WHERE cursor IS NULL;

-- jobs.fail_reason: why a failed group failed (`attempts` when NULL; `cancelled`,
-- `reward_service`, `result_too_large`).
ALTER TABLE jobs ADD COLUMN fail_reason TEXT CHECK (fail_reason IS NULL OR state = 'failed');
-- Status counts open and failed jobs through these instead of scanning every job.
CREATE INDEX jobs_unfinished ON jobs (state) WHERE state IN ('posted', 'pending', 'leased');
CREATE INDEX jobs_failed ON jobs (batch_id) WHERE state = 'failed';

-- Retention: when the trainer read a batch to its end, and when its rows were archived to a
-- file (the batch row stays, with the file's path; its failed groups by reason move to
-- `archived_failures`, its refusal counts stay in `refusals`).
ALTER TABLE batches ADD COLUMN delivered_at INTEGER;
ALTER TABLE batches ADD COLUMN archived_at INTEGER;
ALTER TABLE batches ADD COLUMN archive TEXT;
CREATE INDEX batches_delivered ON batches (delivered_at) WHERE delivered_at IS NOT NULL AND archived_at IS NULL;
CREATE TABLE archived_failures (
    batch_id INTEGER NOT NULL REFERENCES batches (id),
    reason   TEXT    NOT NULL,
    count    INTEGER NOT NULL CHECK (count >= 0),
    PRIMARY KEY (batch_id, reason)
);
