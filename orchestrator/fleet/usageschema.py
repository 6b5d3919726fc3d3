"""The usage ledger's file (``<state_dir>/usage.sqlite3``): its tables, and the one statement that adds usage to
an hour's row, the hours it keys rows by (:mod:`.usage` says what each table is for)."""

import time

HOUR_S = 3600


def hour_bucket(epoch_s: float) -> str:
    """The UTC hour ``epoch_s`` falls in, as the table stores it: ``2026-11-01T13``."""
    return time.strftime("%Y-%m-%dT%H", time.gmtime(epoch_s))


SCHEMA = """
CREATE TABLE IF NOT EXISTS usage (
    hour TEXT NOT NULL,
    key TEXT NOT NULL,
    grp TEXT NOT NULL DEFAULT '',
    model TEXT NOT NULL,
    requests INTEGER NOT NULL DEFAULT 0,
    prompt_tokens INTEGER NOT NULL DEFAULT 0,
    completion_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (hour, key, grp, model)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS usage_by_key ON usage (key, hour);
CREATE TABLE IF NOT EXISTS charged (
    ref TEXT PRIMARY KEY,
    hour TEXT NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS charged_upto (
    ref TEXT PRIMARY KEY,
    hour TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS seen (
    incarnation TEXT NOT NULL,
    key TEXT NOT NULL,
    model TEXT NOT NULL,
    requests INTEGER NOT NULL,
    prompt_tokens INTEGER NOT NULL,
    completion_tokens INTEGER NOT NULL,
    at REAL NOT NULL,
    PRIMARY KEY (incarnation, key, model)
) WITHOUT ROWID;
PRAGMA user_version = 2;
"""
SCHEMA_VERSION = 2   # the file's user_version once SCHEMA ran
UPSERT = """
INSERT INTO usage (hour, key, grp, model, requests, prompt_tokens, completion_tokens) VALUES (?, ?, ?, ?, ?, ?, ?)
ON CONFLICT (hour, key, grp, model) DO UPDATE SET
    requests = requests + excluded.requests,
    prompt_tokens = prompt_tokens + excluded.prompt_tokens,
    completion_tokens = completion_tokens + excluded.completion_tokens
"""
