//! Table-wide walks: `SCAN` of every node holding keys (the server, or each master of a
//! cluster), one page at a time. Walks take turns page by page: one page's work at a time
//! holds Redis from checks, and no walk, however long, keeps another from its turn. A few
//! reading walks (`stats`, `busiest`) run at once, so that a burst of them fails fast
//! instead of crawling on together; deleting walks (the resets) always get their turns.

use tokio::sync::OwnedSemaphorePermit;

use super::client::Client;
use super::connection::ScanNode;
use crate::store::StoreResult;

/// Keys asked of each `SCAN` step: a page's work holds Redis from checks meanwhile.
const SCAN_COUNT: usize = 250;

/// Where a table-wide `SCAN` stands: the nodes left to scan (the current one last) and the
/// cursor in the current one; a reading walk holds a place among those running.
pub struct Scan {
    nodes: Vec<ScanNode>,
    cursor: u64,
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
    pub async fn reading(client: &Client) -> StoreResult<Self> {
        let place = client.walk_place().await?;
        Self::start(client, Some(place)).await
    }

    /// Starts a scan of every node holding keys, to delete what it finds.
    pub async fn deleting(client: &Client) -> StoreResult<Self> {
        Self::start(client, None).await
    }

    async fn start(client: &Client, place: Option<OwnedSemaphorePermit>) -> StoreResult<Self> {
        let mut nodes = client.scan_nodes().await?;
        nodes.reverse();
        Ok(Self {
            nodes,
            cursor: 0,
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
        let turn = client.page_turn().await?;
        let mut command = ::redis::cmd("SCAN");
        command
            .arg(self.cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let (next, names): (u64, Vec<Vec<u8>>) = client.command_on(node, &command).await?;
        self.cursor = next;
        if next == 0 {
            self.nodes.pop();
        }
        Ok(Some(Page { names, _turn: turn }))
    }
}

/// Deletes every key matching `pattern`, one `SCAN` page at a time.
pub async fn unlink_matching(client: &Client, pattern: &[u8]) -> StoreResult<()> {
    let mut scan = Scan::deleting(client).await?;
    while let Some(page) = scan.next_page(client, pattern).await? {
        if !page.names.is_empty() {
            let mut unlink = ::redis::cmd("UNLINK");
            unlink.arg(&page.names);
            let _: u64 = client.command(&unlink).await?;
        }
    }
    Ok(())
}
