-- The job ledger (SQLite dialect). Keep in step with ../postgres/0001_ledger.sql:
-- same tables, columns, constraints and indexes; only types differ.

CREATE TABLE versions (
    version      INTEGER PRIMARY KEY CHECK (version >= 0),
    base         INTEGER REFERENCES versions (version),
    digest       BLOB    NOT NULL CHECK (length(digest) = 16),
    state        TEXT    NOT NULL CHECK (state IN ('staged', 'committed')),
    created_at   INTEGER NOT NULL,
    committed_at INTEGER,
    CHECK ((state = 'committed') = (committed_at IS NOT NULL))
);

CREATE TABLE actors (
    id             TEXT    PRIMARY KEY,
    region         TEXT    NOT NULL,
    hardware       TEXT    NOT NULL,
    active_version INTEGER,
    staged_version INTEGER,
    tau            REAL    NOT NULL CHECK (tau >= 0),
    last_heartbeat INTEGER NOT NULL,
    registered_at  INTEGER NOT NULL
);

CREATE TABLE batches (
    id           INTEGER PRIMARY KEY,
    version      INTEGER NOT NULL REFERENCES versions (version),
    size         INTEGER NOT NULL CHECK (size > 0),
    sampling     TEXT    NOT NULL,
    created_at   INTEGER NOT NULL,
    scheduled_at INTEGER
);

-- The scheduling decision per batch and eligible actor (Algorithm 1's B_a and COMMIT flag).
CREATE TABLE assignments (
    batch_id INTEGER NOT NULL REFERENCES batches (id),
    actor_id TEXT    NOT NULL REFERENCES actors (id),
    count    INTEGER NOT NULL CHECK (count >= 0),
    commit_version INTEGER,
    PRIMARY KEY (batch_id, actor_id)
);

-- One row per prompt. The lease (holder, granted, expiry) lives on the row: a job has at most
-- one lease, and the CHECKs tie the lease columns to the 'leased' state.
CREATE TABLE jobs (
    id            INTEGER PRIMARY KEY,
    batch_id      INTEGER NOT NULL REFERENCES batches (id),
    version       INTEGER NOT NULL REFERENCES versions (version),
    prompt        BLOB    NOT NULL,
    state         TEXT    NOT NULL CHECK (state IN ('posted', 'pending', 'leased', 'done', 'failed')),
    attempts      INTEGER NOT NULL DEFAULT 0 CHECK (attempts >= 0),
    assignee      TEXT    REFERENCES actors (id),
    lease_holder  TEXT    REFERENCES actors (id),
    leased_at     INTEGER,
    lease_expires INTEGER,
    done_at       INTEGER,
    CHECK ((state = 'leased') = (lease_holder IS NOT NULL)),
    CHECK ((lease_holder IS NULL) = (lease_expires IS NULL) AND (lease_holder IS NULL) = (leased_at IS NULL)),
    CHECK (assignee IS NULL OR state = 'pending'),
    CHECK ((state = 'done') = (done_at IS NOT NULL))
);
CREATE INDEX jobs_by_batch ON jobs (batch_id, id);
CREATE INDEX jobs_assigned ON jobs (assignee, id) WHERE state = 'pending' AND assignee IS NOT NULL;
CREATE INDEX jobs_open ON jobs (version, id) WHERE state = 'pending' AND assignee IS NULL;
CREATE INDEX jobs_leases ON jobs (lease_expires) WHERE state = 'leased';

-- Accepted results only: UNIQUE (job_id) makes acceptance exactly-once.
CREATE TABLE results (
    id            INTEGER PRIMARY KEY,
    job_id        INTEGER NOT NULL UNIQUE REFERENCES jobs (id),
    actor_id      TEXT    NOT NULL REFERENCES actors (id),
    version       INTEGER NOT NULL REFERENCES versions (version),
    digest        BLOB    NOT NULL CHECK (length(digest) = 16),
    tokens        INTEGER NOT NULL CHECK (tokens >= 0),
    elapsed_ms    INTEGER NOT NULL CHECK (elapsed_ms >= 0),
    completion_ms INTEGER NOT NULL CHECK (completion_ms >= 0),
    payload       BLOB    NOT NULL,
    accepted_at   INTEGER NOT NULL
);
