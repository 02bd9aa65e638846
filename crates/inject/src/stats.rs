//! Statistics for campaigns: Wilson score intervals, the one-sided bound for zero events,
//! and Leveugle et al.'s sample-size formula for statistical fault injection.

/// Two-sided normal quantile for a confidence level given in percent (90, 95, 99, 99.9).
pub fn z_for(confidence: f64) -> f64 {
    match confidence {
        c if (c - 90.0).abs() < 1e-9 => 1.644_853_6,
        c if (c - 95.0).abs() < 1e-9 => 1.959_964,
        c if (c - 99.0).abs() < 1e-9 => 2.575_829_3,
        c if (c - 99.9).abs() < 1e-9 => 3.290_526_7,
        _ => inverse_normal(0.5 + confidence / 200.0),
    }
}

/// Acklam's rational approximation of the standard normal quantile (|error| < 1.2e-9).
fn inverse_normal(p: f64) -> f64 {
    assert!(p > 0.0 && p < 1.0, "quantile of {p}");
    const A: [f64; 6] = [
        -3.969683028665376e1,
        2.209460984245205e2,
        -2.759285104469687e2,
        1.38357751867269e2,
        -3.066479806614716e1,
        2.506628277459239,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e1,
        1.615858368580409e2,
        -1.556989798598866e2,
        6.680131188771972e1,
        -1.328068155288572e1,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-3,
        -3.223964580411365e-1,
        -2.400758277161838,
        -2.549732539343734,
        4.374664141464968,
        2.938163982698783,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-3,
        3.224671290700398e-1,
        2.445134137142996,
        3.754408661907416,
    ];
    let tail = |q: f64| {
        (((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    };
    if p < 0.02425 {
        tail((-2.0 * p.ln()).sqrt())
    } else if p > 1.0 - 0.02425 {
        -tail((-2.0 * (1.0 - p).ln()).sqrt())
    } else {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    }
}

/// Wilson score interval for `k` successes in `n` trials, as fractions.
pub fn wilson(k: u64, n: u64, confidence: f64) -> (f64, f64) {
    if n == 0 {
        return (0.0, 1.0);
    }
    let z = z_for(confidence);
    let (k, n) = (k as f64, n as f64);
    let p = k / n;
    let denom = 1.0 + z * z / n;
    let centre = (p + z * z / (2.0 * n)) / denom;
    let half = z * ((p * (1.0 - p) / n) + z * z / (4.0 * n * n)).sqrt() / denom;
    ((centre - half).max(0.0), (centre + half).min(1.0))
}

/// One-sided upper bound on the rate when 0 events were seen in `n` trials:
/// 1 - (1 - c)^(1/n) (about 3/n at 95%, the "rule of three").
pub fn zero_upper_bound(n: u64, confidence: f64) -> f64 {
    if n == 0 {
        return 1.0;
    }
    1.0 - (1.0 - confidence / 100.0).powf(1.0 / n as f64)
}

/// Leveugle et al. (DATE 2009): injections needed for margin `e` at `confidence`, with
/// `population` possible faults (None: unbounded) and the worst case p = 0.5.
pub fn sample_size(confidence: f64, margin: f64, population: Option<f64>) -> u64 {
    let t = z_for(confidence);
    let p = 0.5;
    let infinite = t * t * p * (1.0 - p) / (margin * margin);
    let n = match population {
        Some(big_n) => big_n / (1.0 + margin * margin * (big_n - 1.0) / (t * t * p * (1.0 - p))),
        None => infinite,
    };
    n.ceil() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_known_values() {
        // 10 of 100 at 95%: [0.0552, 0.1744] (Wilson 1927; standard tables).
        let (lo, hi) = wilson(10, 100, 95.0);
        assert!((lo - 0.0552).abs() < 5e-4 && (hi - 0.1744).abs() < 5e-4, "{lo} {hi}");
        let (lo, hi) = wilson(0, 50, 95.0);
        assert_eq!(lo, 0.0);
        assert!((hi - 0.0714).abs() < 5e-4, "{hi}");
    }

    #[test]
    fn zero_bound_is_about_three_over_n() {
        let b = zero_upper_bound(3000, 95.0);
        assert!((b - 3.0 / 3000.0).abs() < 2e-5, "{b}");
    }

    #[test]
    fn leveugle_sample_sizes() {
        // 95%, 1% margin, unbounded population: 9604 (1.96^2 * 0.25 / 0.0001).
        assert_eq!(sample_size(95.0, 0.01, None), 9604);
        // A finite population needs fewer.
        assert!(sample_size(95.0, 0.01, Some(20_000.0)) < 9604);
        assert_eq!(sample_size(99.0, 0.05, None), 664);
    }

    #[test]
    fn quantiles() {
        assert!((z_for(95.0) - 1.96).abs() < 1e-3);
        assert!((inverse_normal(0.975) - 1.959_964).abs() < 1e-6);
        assert!((z_for(80.0) - 1.281_551_6).abs() < 1e-6);
    }
}
