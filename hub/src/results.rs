//! The trainer's view of accepted results: each one rendered as the JSON document the
//! results endpoint serves (`docs/api.md`), pages of them bounded in count and in bytes, and
//! the archive files retention writes (the same documents, one per line, in cursor order).
//!
//! Never past a result not delivered: a page ends before the first result that cannot be
//! rendered, and if that is its first one the read fails naming it — the cursor handed back
//! is always the last result actually in the page.

use std::io::{BufRead, BufReader};
use std::path::Path;

use serde::{Deserialize, Serialize};
use starling_ledger::AcceptedResult;

use crate::rollouts::StoredResult;

/// The most JSON one results page carries (always at least one result).
pub(crate) const MAX_PAGE_BYTES: usize = 8 << 20;

/// One result as the trainer reads it.
#[derive(Debug, Serialize)]
struct ResultOut<'a> {
    cursor: i64,
    job: i64,
    batch: i64,
    actor: &'a str,
    attempt: u32,
    version: u64,
    accepted_at_ms: i64,
    #[serde(flatten)]
    stored: StoredResult,
}

/// A stored result that cannot be served (it does not parse, or holds a value JSON cannot
/// carry).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("the result at cursor {cursor} (job {job}) cannot be read: {why}")]
pub(crate) struct Unreadable {
    pub(crate) cursor: i64,
    pub(crate) job: i64,
    pub(crate) why: String,
}

/// One result's JSON document.
pub(crate) fn render(batch: i64, r: &AcceptedResult) -> Result<Vec<u8>, Unreadable> {
    let unreadable = |why: String| Unreadable {
        cursor: r.cursor,
        job: r.job.raw(),
        why,
    };
    let stored: StoredResult =
        serde_json::from_slice(&r.payload).map_err(|e| unreadable(e.to_string()))?;
    serde_json::to_vec(&ResultOut {
        cursor: r.cursor,
        job: r.job.raw(),
        batch,
        actor: r.actor.as_str(),
        attempt: r.attempt,
        version: r.version.number(),
        accepted_at_ms: r.accepted_at.millis(),
        stored,
    })
    .map_err(|e| unreadable(e.to_string()))
}

/// A page of rendered results.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct Page {
    /// The JSON documents, in cursor order.
    pub(crate) docs: Vec<Vec<u8>>,
    /// The cursor of the last one (or the cursor asked after, when empty).
    pub(crate) cursor: i64,
    /// Whether the page stopped before results that were there (full in count or bytes).
    pub(crate) cut: bool,
}

impl Page {
    /// `{"results": [...], "cursor": C, "done": D}`.
    pub(crate) fn body(&self, done: bool) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.docs.iter().map(Vec::len).sum::<usize>() + 64);
        out.extend_from_slice(b"{\"results\":[");
        for (i, d) in self.docs.iter().enumerate() {
            if i > 0 {
                out.push(b',');
            }
            out.extend_from_slice(d);
        }
        out.extend_from_slice(format!("],\"cursor\":{},\"done\":{done}}}", self.cursor).as_bytes());
        out
    }
}

/// Fills a page from rendered documents `(cursor, document)`, in order: at most `limit`, and
/// no more than [`MAX_PAGE_BYTES`] of JSON with the page's framing (at least one). Stops at
/// the first error; it is returned only when the page is still empty (else the page ends
/// before it, and the next read starts there).
pub(crate) fn fill(
    after: i64,
    limit: usize,
    docs: impl IntoIterator<Item = Result<(i64, Vec<u8>), Unreadable>>,
) -> Result<Page, Unreadable> {
    let mut page = Page {
        cursor: after,
        ..Page::default()
    };
    // `{"results":[` … `],"cursor":…,"done":false}`.
    let mut bytes = 64usize;
    for doc in docs {
        let (cursor, doc) = match doc {
            Ok(d) => d,
            Err(e) if page.docs.is_empty() => return Err(e),
            Err(_) => {
                page.cut = true;
                break;
            }
        };
        if page.docs.len() >= limit
            || (!page.docs.is_empty() && bytes + doc.len() + 1 > MAX_PAGE_BYTES)
        {
            page.cut = true;
            break;
        }
        bytes += doc.len() + 1;
        page.cursor = cursor;
        page.docs.push(doc);
    }
    Ok(page)
}

/// Results after `after` from an archive file, as rendered documents.
pub(crate) fn archived(
    path: &Path,
    after: i64,
) -> std::io::Result<impl Iterator<Item = Result<(i64, Vec<u8>), Unreadable>>> {
    #[derive(Deserialize)]
    struct Head {
        cursor: i64,
    }
    let file = path.display().to_string();
    let lines = BufReader::new(std::fs::File::open(path)?).split(b'\n');
    Ok(lines.filter_map(move |line| {
        let unreadable = |why: String| Unreadable {
            cursor: after,
            job: 0,
            why: format!("{why} (archive {file})"),
        };
        match line {
            Ok(l) if l.is_empty() => None,
            Ok(l) => match serde_json::from_slice::<Head>(&l) {
                Ok(h) if h.cursor <= after => None,
                Ok(h) => Some(Ok((h.cursor, l))),
                Err(e) => Some(Err(unreadable(format!("a line does not parse: {e}")))),
            },
            Err(e) => Some(Err(unreadable(format!("read: {e}")))),
        }
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(c: i64, len: usize) -> Result<(i64, Vec<u8>), Unreadable> {
        Ok((c, vec![b' '; len]))
    }

    fn bad(c: i64) -> Result<(i64, Vec<u8>), Unreadable> {
        Err(Unreadable {
            cursor: c,
            job: c,
            why: "broken".into(),
        })
    }

    #[test]
    fn a_page_never_moves_the_cursor_past_a_result_it_does_not_hold() {
        // An unreadable result after readable ones: the page ends before it.
        let p = fill(3, 10, [doc(4, 10), doc(5, 10), bad(6), doc(7, 10)]).expect("page");
        assert_eq!((p.docs.len(), p.cursor, p.cut), (2, 5, true));
        // An unreadable result first: an error naming it, no page (before: skipped, and the
        // cursor moved past it with `results: []`).
        let e = fill(5, 10, [bad(6), doc(7, 10)]).expect_err("named");
        assert_eq!((e.cursor, e.job), (6, 6));
        assert!(e.to_string().contains("cursor 6"), "{e}");
    }

    #[test]
    fn a_page_holds_at_most_its_limit_and_8_mib_but_always_one() {
        let p = fill(0, 2, [doc(1, 5), doc(2, 5), doc(3, 5)]).expect("page");
        assert_eq!((p.docs.len(), p.cursor, p.cut), (2, 2, true));
        let mib = 1 << 20;
        let p = fill(0, 100, [doc(1, 3 * mib), doc(2, 3 * mib), doc(3, 3 * mib)]).expect("page");
        assert_eq!((p.docs.len(), p.cursor, p.cut), (2, 2, true));
        assert!(p.body(false).len() <= MAX_PAGE_BYTES);
        let p = fill(0, 100, [doc(1, 20 * mib), doc(2, 1)]).expect("page");
        assert_eq!(
            (p.docs.len(), p.cursor),
            (1, 1),
            "one result even over the bound"
        );
        let p = fill(9, 100, std::iter::empty()).expect("page");
        assert_eq!((p.docs.len(), p.cursor, p.cut), (0, 9, false));
        let body: serde_json::Value = serde_json::from_slice(
            &fill(0, 9, [Ok((1, b"{\"a\":1}".to_vec()))])
                .expect("page")
                .body(true),
        )
        .expect("json");
        assert_eq!(
            body,
            serde_json::json!({"results": [{"a": 1}], "cursor": 1, "done": true})
        );
    }
}
