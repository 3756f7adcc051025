-- Leases that fit the job (PostgreSQL dialect). Keep in step with ../sqlite/0003_leases.sql.
--
-- jobs: the job's token budget (n × max_new_tokens + prompt tokens, computed by the hub when
-- it posts the group; 0 = unknown), the job connection (session) that holds its lease, and the
-- progress its holder last reported (tokens so far, when).
ALTER TABLE jobs ADD COLUMN budget BIGINT NOT NULL DEFAULT 0 CHECK (budget >= 0);
ALTER TABLE jobs ADD COLUMN lease_session BIGINT;
ALTER TABLE jobs ADD COLUMN progress_tokens BIGINT NOT NULL DEFAULT 0 CHECK (progress_tokens >= 0);
ALTER TABLE jobs ADD COLUMN progress_at BIGINT;
CREATE INDEX jobs_held ON jobs (lease_holder, lease_session) WHERE state = 'leased';

-- actors: the number of its newest job connection (each registration takes the next), what
-- the hub measured of it on its own clock (samples taken; the start of the interval the next
-- accepted submit is measured over), and when its share was last taken back unclaimed (an
-- actor that heartbeats but does not claim is not scheduled again until it claims).
ALTER TABLE actors ADD COLUMN session BIGINT NOT NULL DEFAULT 0 CHECK (session >= 0);
ALTER TABLE actors ADD COLUMN measured BIGINT NOT NULL DEFAULT 0 CHECK (measured >= 0);
ALTER TABLE actors ADD COLUMN busy_since BIGINT;
ALTER TABLE actors ADD COLUMN stalled_at BIGINT;

-- assignments: when its actor last claimed from this share (the claim timeout counts from
-- here, or from the batch's scheduling before the first claim).
ALTER TABLE assignments ADD COLUMN claimed_at BIGINT;
