-- Schema of a run's store (<run dir>/store.sqlite), version 2 (PRAGMA user_version).
-- Version 2 changed only views (db.py upgrades version-1 files by recreating them).
-- Views and indexes are derived and do not count as a version: a writable open adds
-- the indexes a file lacks (db.install_schema).
--
-- One file holds everything a run needs to resume: the rollout queue and its
-- attempts, every span (LLM calls with their token arrays, rewards), the
-- versioned resources, and the run state (config, checkpoints, metrics).
-- Status semantics: see agl/store/rules.py (the canonical description).
--
-- Conventions
--   * Times are seconds since the epoch (REAL), from the store's clock.
--   * JSON columns hold JSON text; query them with json_extract().
--   * Token arrays are BLOBs: ids as little-endian int32, logprobs as
--     little-endian float32; length(blob)/4 is the token count.
--   * Every query the store runs on the hot path is an index probe, so the cost
--     of an operation does not grow with the number of rollouts.

-- One row per writable SqliteStore that opened the file (one per process), and one
-- per client of a store served over HTTP (agl/store/server.py; a runner or a job
-- on any host), whose liveness is its heartbeats, not its pid.
-- Attempts record the session that created them; when a session ends (close, or
-- its process is found dead, or its heartbeats stopped) its active attempts become
-- 'unresponsive' with the note {"harness_ended": close_reason, "error": ...} in
-- their metadata, and their rollouts go back to the queue without using up a retry
-- (rule R7).
CREATE TABLE IF NOT EXISTS sessions (
    session_id          TEXT PRIMARY KEY,  -- 'se-000001', ... in the order opened
    pid                 INTEGER NOT NULL,
    process_start_time  REAL,            -- guards against pid reuse
    hostname            TEXT NOT NULL,
    opened_time         REAL NOT NULL,
    closed_time         REAL,            -- NULL while the session is open
    close_reason        TEXT,            -- 'closed' | 'dead'
    -- a client's session (NULL for a process's): dead once heartbeat_time + heartbeat_seconds
    -- has passed (store clock). Added after version 2 (db.ADDED_COLUMNS); older code ignores them.
    heartbeat_seconds   REAL,
    heartbeat_time      REAL
);
CREATE INDEX IF NOT EXISTS sessions_open ON sessions(opened_time) WHERE closed_time IS NULL;

-- Versioned named resources (e.g. {"llm": {...}, "policy_version": 3}).
-- The latest resources are the ones added or updated last (highest version).
CREATE TABLE IF NOT EXISTS resources (
    resources_id  TEXT PRIMARY KEY,      -- given, or 'rs-' || the version it was added with
    resources     TEXT NOT NULL,         -- JSON object
    version       INTEGER NOT NULL,      -- bumped by add_resources / update_resources
    create_time   REAL NOT NULL,
    update_time   REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS resources_by_version ON resources(version);

CREATE TABLE IF NOT EXISTS rollouts (
    seq            INTEGER PRIMARY KEY,  -- creation order
    rollout_id     TEXT NOT NULL UNIQUE,  -- 'ro-' || seq, zero-padded: 'ro-000001'
    input          TEXT,                 -- JSON
    mode           TEXT,                 -- 'train' | 'val' | 'test' | NULL
    resources_id   TEXT REFERENCES resources(resources_id),
    status         TEXT NOT NULL,        -- see agl/store/rules.py
    config         TEXT NOT NULL,        -- JSON RolloutConfig
    metadata       TEXT,                 -- JSON object; metadata.step = training step
    start_time     REAL NOT NULL,        -- creation time
    end_time       REAL,                 -- set on entering a terminal status
    num_attempts   INTEGER NOT NULL DEFAULT 0,  -- sequence_id of the latest attempt
    last_span_seq  INTEGER NOT NULL DEFAULT 0,  -- last span sequence_id issued
    queue_seq      INTEGER,              -- FIFO position while queuing/requeuing, else NULL
    step           INTEGER GENERATED ALWAYS AS (json_extract(metadata, '$.step')) VIRTUAL
);
-- The queue: only queued rollouts are in this index; dequeue reads its first entry.
CREATE INDEX IF NOT EXISTS rollouts_queue ON rollouts(queue_seq) WHERE queue_seq IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_status ON rollouts(status);
CREATE INDEX IF NOT EXISTS rollouts_step ON rollouts(step) WHERE step IS NOT NULL;
-- The evaluations' tags (agl/evaluate.py: eval_step for the trainers' evals, eval for
-- algo=eval, candidate for algo=prompt_search): query_rollouts(metadata={...}) probes
-- these. Partial, so rollouts without the key cost nothing beyond the check at insert.
CREATE INDEX IF NOT EXISTS rollouts_eval_step ON rollouts(json_extract(metadata, '$.eval_step'))
    WHERE json_extract(metadata, '$.eval_step') IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_eval ON rollouts(json_extract(metadata, '$.eval'))
    WHERE json_extract(metadata, '$.eval') IS NOT NULL;
CREATE INDEX IF NOT EXISTS rollouts_candidate ON rollouts(json_extract(metadata, '$.candidate'))
    WHERE json_extract(metadata, '$.candidate') IS NOT NULL;

CREATE TABLE IF NOT EXISTS attempts (
    attempt_id            TEXT PRIMARY KEY,     -- 'at-000001-2': attempt 2 of 'ro-000001'
    rollout_id            TEXT NOT NULL REFERENCES rollouts(rollout_id),
    sequence_id           INTEGER NOT NULL,     -- 1, 2, ... within the rollout
    status                TEXT NOT NULL,
    start_time            REAL NOT NULL,
    end_time              REAL,
    worker_id             TEXT,
    last_heartbeat_time   REAL,
    metadata              TEXT,                 -- JSON object; $.harness_ended: see sessions
    session_id            TEXT REFERENCES sessions(session_id),  -- owner (rule R7)
    timeout_at            REAL,                 -- start_time + config.timeout_seconds
    unresponsive_seconds  REAL,                 -- config.unresponsive_seconds
    -- When the watchdog must look at this attempt next (rule R6); NULL when it is
    -- not active or has no limits. Derived, so it can never go stale.
    deadline REAL GENERATED ALWAYS AS (
        CASE WHEN status IN ('preparing', 'running') THEN
            nullif(min(coalesce(timeout_at, 9e999),
                       coalesce(coalesce(last_heartbeat_time, start_time) + unresponsive_seconds, 9e999)),
                   9e999)
        END) VIRTUAL,
    UNIQUE (rollout_id, sequence_id)
);
CREATE INDEX IF NOT EXISTS attempts_deadline ON attempts(deadline) WHERE deadline IS NOT NULL;
CREATE INDEX IF NOT EXISTS attempts_active_by_session ON attempts(session_id)
    WHERE status IN ('preparing', 'running');

-- One row per span; token arrays inline as BLOBs (not one row per token).
CREATE TABLE IF NOT EXISTS spans (
    id                  INTEGER PRIMARY KEY,
    rollout_id          TEXT NOT NULL,
    attempt_id          TEXT NOT NULL REFERENCES attempts(attempt_id),
    sequence_id         INTEGER NOT NULL,  -- increasing within the rollout
    span_id             TEXT NOT NULL,
    trace_id            TEXT,
    parent_id           TEXT,
    name                TEXT NOT NULL,     -- 'llm.chat', 'llm.completion', 'reward', ...
    start_time          REAL,
    end_time            REAL,
    attributes          TEXT NOT NULL,     -- JSON object ('reward', 'policy_version', ...)
    prompt_token_ids    BLOB,              -- int32 little-endian
    response_token_ids  BLOB,              -- int32 little-endian
    response_logprobs   BLOB               -- float32 little-endian
);
CREATE INDEX IF NOT EXISTS spans_by_attempt ON spans(rollout_id, attempt_id, sequence_id);

-- Run state -----------------------------------------------------------------

-- Free-form run facts: the run's config, code version, ... (JSON values).
CREATE TABLE IF NOT EXISTS run_info (
    key          TEXT PRIMARY KEY,
    value        TEXT NOT NULL,           -- JSON
    update_time  REAL NOT NULL
);

-- One row per saved training step. state: JSON (data-loader cursor, RNG states,
-- ...). Binary state lives in checkpoint_blobs; only the last K checkpoints keep
-- their blobs (SqliteStore(keep_checkpoints=K)), older rows keep their JSON.
CREATE TABLE IF NOT EXISTS checkpoints (
    step            INTEGER PRIMARY KEY,
    policy_version  INTEGER NOT NULL,
    state           TEXT NOT NULL,        -- JSON object
    created_time    REAL NOT NULL,
    blobs_pruned    INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS checkpoint_blobs (
    step  INTEGER NOT NULL REFERENCES checkpoints(step) ON DELETE CASCADE,
    name  TEXT NOT NULL,                  -- 'adapter', 'optimizer', 'torch_rng', ...
    data  BLOB NOT NULL,
    PRIMARY KEY (step, name)
);

-- Per-step metrics in long form: one row per (step, name).
CREATE TABLE IF NOT EXISTS metrics (
    step   INTEGER NOT NULL,
    name   TEXT NOT NULL,                 -- nested dicts are flattened with '/'
    value,                                -- number, text or NULL
    time   REAL NOT NULL,
    PRIMARY KEY (step, name)
);

-- Views ------------------------------------------------------------------------

-- Each rollout with its latest attempt. harness_ended: 'dead' | 'closed' if that
-- attempt was cut short by the end of its harness session (R7), else NULL.
CREATE VIEW IF NOT EXISTS latest_attempts AS
SELECT r.rollout_id, r.step, r.mode, r.status AS rollout_status,
       a.attempt_id, a.sequence_id, a.status AS attempt_status, a.worker_id,
       a.session_id, a.start_time, a.end_time, a.last_heartbeat_time,
       json_extract(a.metadata, '$.harness_ended') AS harness_ended
FROM rollouts r
JOIN attempts a ON a.rollout_id = r.rollout_id AND a.sequence_id = r.num_attempts;

-- Each rollout with its final reward: the value of the last 'reward' span of its
-- latest attempt (NULL if that attempt wrote none). interrupted_attempts: its
-- attempts cut short by a harness death or close (R7; they use no retry).
CREATE VIEW IF NOT EXISTS rollout_rewards AS
SELECT r.rollout_id, r.step, r.mode, r.status, r.resources_id, r.num_attempts,
       (SELECT count(*) FROM attempts h
         WHERE h.rollout_id = r.rollout_id AND json_extract(h.metadata, '$.harness_ended') IS NOT NULL)
         AS interrupted_attempts,
       r.start_time, r.end_time,
       (SELECT json_extract(s.attributes, '$.reward') FROM spans s
         WHERE s.rollout_id = r.rollout_id AND s.attempt_id = a.attempt_id AND s.name = 'reward'
         ORDER BY s.sequence_id DESC LIMIT 1) AS reward
FROM rollouts r
LEFT JOIN attempts a ON a.rollout_id = r.rollout_id AND a.sequence_id = r.num_attempts;

-- One row per training step (rollouts with metadata.step). retried: rollouts the
-- agent tried more than once (retries after agent failures, R4); interrupted:
-- rollouts rerun because a harness died or closed under them (R7).
CREATE VIEW IF NOT EXISTS step_summary AS
SELECT step,
       count(*)                                                    AS rollouts,
       sum(status = 'succeeded')                                   AS succeeded,
       sum(status = 'failed')                                      AS failed,
       sum(status = 'cancelled')                                   AS cancelled,
       sum(status NOT IN ('succeeded', 'failed', 'cancelled'))     AS unfinished,
       sum(num_attempts - interrupted_attempts > 1)                AS retried,
       sum(interrupted_attempts > 0)                               AS interrupted,
       count(reward)                                               AS rewarded,
       avg(reward)                                                 AS mean_reward,
       min(reward)                                                 AS min_reward,
       max(reward)                                                 AS max_reward,
       min(start_time)                                             AS first_start,
       max(end_time)                                               AS last_end
FROM rollout_rewards
WHERE step IS NOT NULL
GROUP BY step;

-- Every attempt with its duration and span count (harness_ended as in latest_attempts).
CREATE VIEW IF NOT EXISTS attempt_durations AS
SELECT a.rollout_id, a.attempt_id, a.sequence_id, a.status, a.worker_id, a.session_id,
       json_extract(a.metadata, '$.harness_ended') AS harness_ended,
       a.start_time, a.end_time,
       a.end_time - a.start_time                  AS duration,
       a.last_heartbeat_time - a.start_time       AS last_heartbeat_after,
       (SELECT count(*) FROM spans s
         WHERE s.rollout_id = a.rollout_id AND s.attempt_id = a.attempt_id) AS spans
FROM attempts a;

-- Every LLM call (spans named 'llm.*') with token counts.
CREATE VIEW IF NOT EXISTS llm_calls AS
SELECT s.rollout_id, s.attempt_id, s.sequence_id, s.name,
       json_extract(s.attributes, '$.policy_version') AS policy_version,
       json_extract(s.attributes, '$.finish_reason')  AS finish_reason,
       length(s.prompt_token_ids) / 4                  AS prompt_tokens,
       length(s.response_token_ids) / 4                AS response_tokens,
       s.end_time - s.start_time                       AS latency
FROM spans s
WHERE s.name LIKE 'llm.%';

-- Checkpoints with the size of the blobs they still hold.
CREATE VIEW IF NOT EXISTS checkpoint_sizes AS
SELECT c.step, c.policy_version, c.created_time, c.blobs_pruned,
       (SELECT count(*) FROM checkpoint_blobs b WHERE b.step = c.step)                   AS blobs,
       (SELECT coalesce(sum(length(b.data)), 0) FROM checkpoint_blobs b WHERE b.step = c.step) AS blob_bytes
FROM checkpoints c;
