//! P1 over what went out of one bucket: for the tests that count it.

/// Checks that the cost in `sent` over any interval of length T is at most
/// `max(capacity, c_max) + refill * T`, `c_max` being the largest cost in it. Each cost
/// went out at an instant known to lie in a span, `(earliest, latest, cost)` in ns, in
/// any order; `earliest` may be up to a millisecond late (delays round up). An interval
/// counts the costs whose spans it holds. Returns the first interval past the bound,
/// described.
pub fn first_excess(capacity: f64, refill: f64, sent: &mut [(u64, u64, f64)]) -> Option<String> {
    sent.sort_by_key(|&(earliest, latest, _)| (latest, earliest));
    let mut starts: Vec<u64> = sent.iter().map(|&(earliest, ..)| earliest).collect();
    starts.sort_unstable();
    starts.dedup();
    for from in starts {
        let (mut total, mut largest) = (0.0, 0.0f64);
        for &(_, to, cost) in sent.iter().filter(|&&(earliest, ..)| earliest >= from) {
            total += cost;
            largest = largest.max(cost);
            let span = (to - from) as f64 / 1e9;
            let bound = capacity.max(largest) + refill * (span + 0.001) + 1e-6;
            if total > bound {
                return Some(format!("{total} > {bound} over {span} s from {from} ns"));
            }
        }
    }
    None
}
