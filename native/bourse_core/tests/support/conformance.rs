//! P1 over what went out of one bucket: for the tests that count it.

/// Checks that the cost in `sent` (`(instant in ns, cost)`, in any order) over any
/// interval of length T is at most `max(capacity, c_max) + refill * T`, `c_max` being
/// the largest cost in it; an instant may be up to a millisecond late (delays round up).
/// Returns the first interval past the bound, described.
pub fn first_excess(capacity: f64, refill: f64, sent: &mut [(u64, f64)]) -> Option<String> {
    sent.sort_by_key(|&(at, _)| at);
    for i in 0..sent.len() {
        let (mut total, mut largest) = (0.0, 0.0f64);
        for &(at, cost) in &sent[i..] {
            total += cost;
            largest = largest.max(cost);
            let span = (at - sent[i].0) as f64 / 1e9;
            let bound = capacity.max(largest) + refill * (span + 0.001) + 1e-6;
            if total > bound {
                return Some(format!("{total} > {bound} over {span} s from #{i}"));
            }
        }
    }
    None
}
