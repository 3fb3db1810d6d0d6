//! The busiest keys of a walk, picked as it goes: the rows kept are never more than asked.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::types::KeyInfo;

/// The `count` busy rows with the most tokens borrowed among those offered, busiest first;
/// of rows borrowing as much, the one offered first. Holds at most `count` rows, and takes
/// the key of a row only when the row is kept.
pub struct Busiest<K> {
    count: usize,
    offered: u64,
    /// Its greatest row is the one to leave first.
    rows: BinaryHeap<Row<K>>,
}

struct Row<K> {
    offered: u64,
    key: K,
    info: KeyInfo,
}

impl<K> Busiest<K> {
    /// None kept yet, `count` at most.
    pub fn new(count: usize) -> Self {
        Self {
            count,
            offered: 0,
            rows: BinaryHeap::new(),
        }
    }

    /// Offers the row of `info`, whose key `key` makes. A key that neither borrows nor
    /// holds bookings is not busy, and passed over.
    pub fn offer(&mut self, info: KeyInfo, key: impl FnOnce() -> K) {
        if info.borrowed <= 0.0 && info.bookings == 0 {
            return;
        }
        let offered = self.offered;
        self.offered += 1;
        if self.rows.len() < self.count {
            self.rows.push(Row {
                offered,
                key: key(),
                info,
            });
        } else if let Some(mut last) = self.rows.peek_mut() {
            // Offered after every row held, it ranks before one only by borrowing more.
            if info.borrowed.total_cmp(&last.info.borrowed).is_gt() {
                *last = Row {
                    offered,
                    key: key(),
                    info,
                };
            }
        }
    }

    /// Offers the rows `other` kept, in the order they were offered to it: of rows as
    /// busy, those of `self` rank first.
    pub fn absorb(&mut self, other: Busiest<K>) {
        let mut rows = other.rows.into_vec();
        rows.sort_unstable_by_key(|row| row.offered);
        for row in rows {
            self.offer(row.info, || row.key);
        }
    }

    /// The rows kept, busiest first.
    pub fn into_rows(self) -> Vec<(K, KeyInfo)> {
        let rows = self.rows.into_sorted_vec();
        rows.into_iter().map(|row| (row.key, row.info)).collect()
    }
}

/// Rows rank busiest first: the greater of two is the one listed after.
impl<K> Ord for Row<K> {
    fn cmp(&self, other: &Self) -> Ordering {
        other
            .info
            .borrowed
            .total_cmp(&self.info.borrowed)
            .then(self.offered.cmp(&other.offered))
    }
}

impl<K> PartialOrd for Row<K> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<K> PartialEq for Row<K> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other).is_eq()
    }
}

impl<K> Eq for Row<K> {}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn info(borrowed: f64, bookings: usize) -> KeyInfo {
        KeyInfo {
            borrowed,
            bookings,
            ..KeyInfo::paused(0)
        }
    }

    proptest! {
        /// The rows of a stable sort of every busy row, busiest first, cut to `count`.
        #[test]
        fn keeps_what_sorting_every_row_keeps(
            // Few values, so that many rows borrow as much.
            rows in prop::collection::vec((0u8..6, 0usize..3), 0..60),
            count in 0usize..70,
        ) {
            let infos: Vec<KeyInfo> = rows
                .iter()
                .map(|&(borrowed, bookings)| info(f64::from(borrowed) / 2.0, bookings))
                .collect();
            let mut busiest = Busiest::new(count);
            for (key, info) in infos.iter().enumerate() {
                busiest.offer(info.clone(), || key);
            }
            let mut sorted: Vec<(usize, KeyInfo)> = infos
                .into_iter()
                .enumerate()
                .filter(|(_, info)| info.borrowed > 0.0 || info.bookings > 0)
                .collect();
            sorted.sort_by(|a, b| b.1.borrowed.total_cmp(&a.1.borrowed));
            sorted.truncate(count);
            prop_assert_eq!(busiest.into_rows(), sorted);
        }
    }

    #[test]
    fn takes_the_key_of_a_row_kept_only() {
        let mut busiest = Busiest::new(2);
        let mut taken = Vec::new();
        for (key, borrowed) in [3.0, 1.0, 2.0, 1.0, 2.0, 5.0, 0.0].into_iter().enumerate() {
            busiest.offer(info(borrowed, 0), || {
                taken.push(key);
                key
            });
        }
        assert_eq!(taken, [0, 1, 2, 5]);
        let kept: Vec<usize> = busiest
            .into_rows()
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        assert_eq!(kept, [5, 0]);
    }
}
