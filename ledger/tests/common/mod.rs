//! Test fixtures: a ledger on a fresh SQLite file, or on a fresh PostgreSQL database created
//! on the server named by `STARLING_TEST_POSTGRES_URL` (skipped, with a message, when unset),
//! and a macro that runs one scenario body against both.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used)]

use std::str::FromStr;
use std::time::Duration;

use sqlx::Connection;
use sqlx::postgres::{PgConnectOptions, PgConnection};
use starling_ledger::{ActorId, Digest, Ledger, LedgerConfig, Timestamp, Version};

pub const PG_ENV: &str = "STARLING_TEST_POSTGRES_URL";

/// Where a test ledger lives; call [`TestDb::cleanup`] at the end.
#[derive(Debug)]
pub enum TestDb {
    Sqlite(tempfile::TempDir),
    Postgres { admin_url: String, name: String },
}

pub async fn sqlite(config: LedgerConfig) -> (Ledger, TestDb) {
    let dir = tempfile::tempdir().expect("create temp dir");
    let url = format!("sqlite:{}", dir.path().join("ledger.db").display());
    let ledger = Ledger::open(&url, config)
        .await
        .expect("open sqlite ledger");
    (ledger, TestDb::Sqlite(dir))
}

/// Reopens the SQLite file of `db` (for restart tests).
pub fn sqlite_url(db: &TestDb) -> String {
    match db {
        TestDb::Sqlite(dir) => format!("sqlite:{}", dir.path().join("ledger.db").display()),
        TestDb::Postgres { .. } => panic!("not an sqlite test db"),
    }
}

/// `admin_url` with its database name replaced by `name`.
pub fn with_database(admin_url: &str, name: &str) -> String {
    let (base, query) = match admin_url.split_once('?') {
        Some((b, q)) => (b, Some(q)),
        None => (admin_url, None),
    };
    let scheme_end = base.find("://").map(|i| i + 3).unwrap_or(0);
    let host_end = base[scheme_end..]
        .find('/')
        .map(|i| scheme_end + i)
        .unwrap_or(base.len());
    let mut url = format!("{}/{}", &base[..host_end], name);
    if let Some(q) = query {
        url.push('?');
        url.push_str(q);
    }
    url
}

pub async fn postgres(config: LedgerConfig, test: &str) -> Option<(Ledger, TestDb)> {
    let Ok(admin_url) = std::env::var(PG_ENV) else {
        println!("skipped {test} on PostgreSQL: {PG_ENV} is not set");
        return None;
    };
    let name = format!(
        "starling_test_{}_{}",
        std::process::id(),
        rand::random::<u64>() % 1_000_000_000_000
    );
    let mut admin = PgConnection::connect_with(
        &PgConnectOptions::from_str(&admin_url).expect("parse admin url"),
    )
    .await
    .expect("connect to the PostgreSQL test server");
    sqlx::raw_sql(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
        .execute(&mut admin)
        .await
        .expect("create test database");
    admin.close().await.expect("close admin connection");
    let ledger = Ledger::open(&with_database(&admin_url, &name), config)
        .await
        .expect("open postgres ledger");
    Some((ledger, TestDb::Postgres { admin_url, name }))
}

impl TestDb {
    pub async fn cleanup(self, ledger: Ledger) {
        ledger.close().await;
        drop(ledger);
        if let TestDb::Postgres { admin_url, name } = self {
            let mut admin = PgConnection::connect(&admin_url)
                .await
                .expect("connect to drop test database");
            sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
            )))
            .execute(&mut admin)
            .await
            .expect("drop test database");
        }
    }
}

/// Runs `async fn $body(&Ledger)` against SQLite and (when configured) PostgreSQL.
#[macro_export]
macro_rules! both_backends {
    ($body:ident, $config:expr) => {
        mod $body {
            use super::*;

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn sqlite() {
                let (ledger, db) = common::sqlite($config).await;
                super::$body(&ledger).await;
                db.cleanup(ledger).await;
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn postgres() {
                let Some((ledger, db)) = common::postgres($config, stringify!($body)).await else {
                    return;
                };
                super::$body(&ledger).await;
                db.cleanup(ledger).await;
            }
        }
    };
}

pub fn v(n: u64) -> Version {
    Version::new(n).expect("small version")
}

pub fn actor(name: &str) -> ActorId {
    ActorId::new(name).expect("valid actor id")
}

pub fn digest_of(version: u64) -> Digest {
    let mut d = [0u8; 16];
    d[..8].copy_from_slice(&version.to_le_bytes());
    d[8..].copy_from_slice(&(!version).to_le_bytes());
    Digest(d)
}

pub const T0: Timestamp = Timestamp::from_millis(1_700_000_000_000);

pub fn at(ms: u64) -> Timestamp {
    T0.plus(Duration::from_millis(ms))
}

/// Registers versions 0..=`upto` as a chain, all committed.
pub async fn versions(ledger: &Ledger, upto: u64) {
    for n in 0..=upto {
        ledger
            .register_version(v(n), n.checked_sub(1).map(v), digest_of(n), T0)
            .await
            .expect("register version");
        ledger
            .commit_version(v(n), T0)
            .await
            .expect("commit version");
    }
}

/// Registers actors on version `active` with a heartbeat at `now`.
pub async fn actors_on(ledger: &Ledger, names: &[&str], active: u64, now: Timestamp) {
    for n in names {
        let a = actor(n);
        ledger
            .register_actor(&a, "test-region", "cpu", now)
            .await
            .expect("register actor");
        ledger
            .heartbeat(&a, Some(v(active)), None, now)
            .await
            .expect("heartbeat");
    }
}

pub fn prompts(n: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| format!("prompt {i}").into_bytes()).collect()
}
