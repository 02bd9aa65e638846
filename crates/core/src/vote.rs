//! Majority voting with consensus on the faulty replica (RCoE, Listing 5).
//!
//! Each replica's value is compared with every other's; a replica's score is the number
//! of values equal to its own, itself included. A single faulty replica is the unique
//! lowest scorer, *and* every other replica must score `n - 1` (they agree with each other
//! and with nobody else). Anything else, such as two faults, all values different, or a
//! tie, has no consensus and must halt.

/// The outcome of a vote over `n` replica values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// All values are equal.
    Unanimous,
    /// Exactly one replica (by position) disagrees with an agreeing majority.
    Faulty(usize),
    /// No agreement on who is faulty: stop.
    NoConsensus,
}

/// Votes over the replicas' values. `values.len()` is the number of live replicas.
pub fn vote<T: PartialEq>(values: &[T]) -> Verdict {
    let n = values.len();
    assert!(n >= 1, "a vote needs at least one replica");
    let score = |i: usize| values.iter().filter(|v| **v == values[i]).count();
    let scores: Vec<usize> = (0..n).map(score).collect();
    if scores.iter().all(|&s| s == n) {
        return Verdict::Unanimous;
    }
    // The suspect is the unique lowest scorer; ties mean there is no single suspect.
    let least = *scores.iter().min().expect("n >= 1");
    let mut suspects = (0..n).filter(|&i| scores[i] == least);
    let suspect = suspects.next().expect("min exists");
    if suspects.next().is_some() {
        return Verdict::NoConsensus;
    }
    // Every other replica must agree with all but the suspect.
    let consensus = (0..n).filter(|&i| i != suspect).all(|i| scores[i] == n - 1);
    if consensus {
        Verdict::Faulty(suspect)
    } else {
        Verdict::NoConsensus
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unanimous() {
        assert_eq!(vote(&[7, 7, 7]), Verdict::Unanimous);
        assert_eq!(vote(&[7, 7]), Verdict::Unanimous);
        assert_eq!(vote(&[7]), Verdict::Unanimous);
    }

    #[test]
    fn one_faulty_of_three() {
        assert_eq!(vote(&[1, 2, 2]), Verdict::Faulty(0));
        assert_eq!(vote(&[2, 1, 2]), Verdict::Faulty(1));
        assert_eq!(vote(&[2, 2, 1]), Verdict::Faulty(2));
    }

    #[test]
    fn dmr_mismatch_has_no_consensus() {
        assert_eq!(vote(&[1, 2]), Verdict::NoConsensus);
    }

    #[test]
    fn all_different_has_no_consensus() {
        assert_eq!(vote(&[1, 2, 3]), Verdict::NoConsensus);
    }

    #[test]
    fn two_faulty_of_four_has_no_consensus() {
        assert_eq!(vote(&[1, 1, 2, 3]), Verdict::NoConsensus);
        assert_eq!(vote(&[1, 1, 2, 2]), Verdict::NoConsensus);
    }
}
