//! Table-wide walks: `SCAN` of every node holding keys (the server, or each master of a
//! cluster), one page at a time. Walks take turns page by page: one page's work at a time
//! holds Redis from checks, and no walk, however long, keeps another from its turn. A few
//! reading walks (`stats`, `busiest`) run at once, so that a burst of them fails fast
//! instead of crawling on together; deleting walks (the resets) always get their turns.
//! Each step of a walk (its place and first page, then each further page) is bounded by
//! the timeout, and none starts past the request's last moment to run: a stopped Redis
//! ends a walk within one timeout, a slow one at its caller's deadline.

use std::time::Instant;

use tokio::sync::OwnedSemaphorePermit;

use super::client::Client;
use super::connection::ScanNode;
use crate::store::{LastRun, StoreResult};

/// Keys asked of each `SCAN` step: a page's work holds Redis from checks meanwhile.
const SCAN_COUNT: usize = 250;

/// Where a table-wide `SCAN` stands: the nodes left to scan (the current one last) and the
/// cursor in the current one; a reading walk holds a place among those running.
pub struct Scan {
    nodes: Vec<ScanNode>,
    cursor: u64,
    /// When the first page must be in: the walk's first step began before it.
    first_until: Option<Instant>,
    last_run: LastRun,
    _place: Option<OwnedSemaphorePermit>,
}

/// One page of a scan: the names found, and the client's turn to walk, held while the
/// page's work is done (until the page is dropped).
pub struct Page {
    pub names: Vec<Vec<u8>>,
    _turn: OwnedSemaphorePermit,
}

impl Scan {
    /// Starts a reading scan of every node holding keys, once it has a place among the
    /// reading walks.
    pub async fn reading(client: &Client, last_run: LastRun) -> StoreResult<Self> {
        let until = client.walk_step_until(last_run)?;
        let place = client.walk_place(until).await?;
        Self::start(client, Some(place), until, last_run, None).await
    }

    /// Starts a scan of every node holding keys (of `slot` alone, on a cluster: the
    /// masters serving or moving it), to delete what it finds.
    pub async fn deleting(
        client: &Client,
        last_run: LastRun,
        slot: Option<u16>,
    ) -> StoreResult<Self> {
        let until = client.walk_step_until(last_run)?;
        Self::start(client, None, until, last_run, slot).await
    }

    async fn start(
        client: &Client,
        place: Option<OwnedSemaphorePermit>,
        until: Instant,
        last_run: LastRun,
        slot: Option<u16>,
    ) -> StoreResult<Self> {
        let mut nodes = client.scan_nodes(until, slot).await?;
        nodes.reverse();
        Ok(Self {
            nodes,
            cursor: 0,
            first_until: Some(until),
            last_run,
            _place: place,
        })
    }

    /// The next page of names matching `pattern`, in the client's turn to walk; `None` once
    /// every node was scanned.
    pub async fn next_page(
        &mut self,
        client: &Client,
        pattern: &[u8],
    ) -> StoreResult<Option<Page>> {
        let Some(node) = self.nodes.last() else {
            return Ok(None);
        };
        let until = match self.first_until.take() {
            Some(until) => until,
            None => client.walk_step_until(self.last_run)?,
        };
        let turn = client.page_turn(until).await?;
        let mut command = ::redis::cmd("SCAN");
        command
            .arg(self.cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let (next, names): (u64, Vec<Vec<u8>>) = client.command_on(node, &command, until).await?;
        self.cursor = next;
        if next == 0 {
            self.nodes.pop();
        }
        Ok(Some(Page { names, _turn: turn }))
    }
}

/// Deletes every key matching `pattern` (on a cluster, of `slot` if given), one `SCAN`
/// page at a time, until `last_run`.
pub async fn unlink_matching(
    client: &Client,
    pattern: &[u8],
    last_run: LastRun,
    slot: Option<u16>,
) -> StoreResult<()> {
    let mut scan = Scan::deleting(client, last_run, slot).await?;
    while let Some(page) = scan.next_page(client, pattern).await? {
        if !page.names.is_empty() {
            let mut unlink = ::redis::cmd("UNLINK");
            unlink.arg(&page.names);
            let _: u64 = client.command(&unlink).await?;
        }
    }
    Ok(())
}
