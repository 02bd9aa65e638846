//! Campaign reports: summary.json (the truth), summary.md (a table shaped like SEI's
//! Table 2) and a stacked-bar SVG.

use crate::campaign::{tally, Record};
use crate::classify::Class;
use crate::stats;
use serde::Serialize;
use std::path::Path;

#[derive(Serialize)]
pub struct ClassRow {
    pub class: &'static str,
    pub count: u64,
    /// Percent of activated faults (None for not-activated).
    pub percent: Option<f64>,
    pub interval_low: Option<f64>,
    pub interval_high: Option<f64>,
}

#[derive(Serialize)]
pub struct Summary {
    pub command: Vec<String>,
    pub model: String,
    pub runs: u64,
    pub activated: u64,
    pub confidence: f64,
    pub classes: Vec<ClassRow>,
    /// One-sided upper bound on the sdc rate (percent) when no sdc was seen.
    pub sdc_upper_bound: Option<f64>,
    /// Injections per second per worker, against native runs per second per core (one
    /// golden run at a time): the campaign's efficiency. None when nothing new ran.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub throughput: Option<Rate>,
}

#[derive(Serialize, Clone, Copy)]
pub struct Rate {
    pub runs_per_s_per_worker: f64,
    pub native_runs_per_s_per_core: f64,
    pub ratio: f64,
}

impl Rate {
    pub fn new(new_runs: u64, elapsed_s: f64, workers: usize, golden_runtime_s: f64) -> Option<Rate> {
        if new_runs == 0 || elapsed_s <= 0.0 || golden_runtime_s <= 0.0 {
            return None;
        }
        let per_worker = new_runs as f64 / elapsed_s / workers.max(1) as f64;
        let native = 1.0 / golden_runtime_s;
        Some(Rate {
            runs_per_s_per_worker: per_worker,
            native_runs_per_s_per_core: native,
            ratio: per_worker / native,
        })
    }
}

pub fn summarise(command: &[String], model: &str, records: &[Record], confidence: f64) -> Summary {
    let t = tally(records);
    let runs = records.len() as u64;
    let activated = runs - t.get(&Class::NotActivated).copied().unwrap_or(0);
    let classes = Class::ALL
        .iter()
        .map(|&c| {
            let count = t.get(&c).copied().unwrap_or(0);
            let (percent, lo, hi) = if c == Class::NotActivated || activated == 0 {
                (None, None, None)
            } else {
                let (lo, hi) = stats::wilson(count, activated, confidence);
                (
                    Some(100.0 * count as f64 / activated as f64),
                    Some(100.0 * lo),
                    Some(100.0 * hi),
                )
            };
            ClassRow {
                class: c.name(),
                count,
                percent,
                interval_low: lo,
                interval_high: hi,
            }
        })
        .collect();
    let sdc = t.get(&Class::Sdc).copied().unwrap_or(0);
    let sdc_upper_bound = (sdc == 0 && activated > 0).then(|| 100.0 * stats::zero_upper_bound(activated, confidence));
    Summary {
        command: command.to_vec(),
        model: model.to_string(),
        runs,
        activated,
        confidence,
        classes,
        sdc_upper_bound,
        throughput: None,
    }
}

pub fn markdown(s: &Summary) -> String {
    let mut md = format!(
        "# Fault-injection campaign\n\nCommand: `{}`  \nFault model: `{}`; {} runs, {} activated; intervals are {}% Wilson.\n\n| class | count | % of activated | {}% interval |\n|---|---:|---:|---:|\n",
        s.command.join(" "),
        s.model,
        s.runs,
        s.activated,
        s.confidence,
        s.confidence
    );
    for c in &s.classes {
        let pct = c.percent.map(|p| format!("{p:.2}%")).unwrap_or_else(|| "—".into());
        let iv = match (c.interval_low, c.interval_high) {
            (Some(lo), Some(hi)) => format!("[{lo:.2}%, {hi:.2}%]"),
            _ => "—".into(),
        };
        md.push_str(&format!("| {} | {} | {pct} | {iv} |\n", c.class, c.count));
    }
    if let Some(t) = s.throughput {
        md.push_str(&format!(
            "\nThroughput: {:.1} injections/s per worker vs {:.1} native runs/s per core: {:.2}x.\n",
            t.runs_per_s_per_worker, t.native_runs_per_s_per_core, t.ratio
        ));
    }
    if let Some(b) = s.sdc_upper_bound {
        md.push_str(&format!(
            "\nNo sdc in {} activated faults: the sdc rate is below {b:.3}% ({}% one-sided).\n",
            s.activated, s.confidence
        ));
    }
    md
}

const COLOURS: [(u8, u8, u8); 7] = [
    (0x4c, 0xaf, 0x50),
    (0x21, 0x96, 0xf3),
    (0xff, 0x98, 0x00),
    (0x9c, 0x27, 0xb0),
    (0x79, 0x55, 0x48),
    (0xf4, 0x43, 0x36),
    (0xbd, 0xbd, 0xbd),
];

/// One stacked horizontal bar: the share of each class among all runs, and a legend.
pub fn svg(s: &Summary) -> String {
    use plotters::prelude::*;
    const BAR: f64 = 560.0;
    // Drawing into a String has no I/O to fail.
    const INTO_STRING: &str = "drawing into a string";
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (640, 120)).into_drawing_area();
        root.fill(&WHITE).expect(INTO_STRING);
        let title = format!("{} faults, {} runs", s.model, s.runs);
        root.draw(&Text::new(title, (40, 6), ("sans-serif", 13)))
            .expect(INTO_STRING);
        let mut x: f64 = 40.0;
        for (i, c) in s.classes.iter().enumerate() {
            if c.count == 0 || s.runs == 0 {
                continue;
            }
            let width = BAR * c.count as f64 / s.runs as f64;
            let (r, g, b) = COLOURS[i % COLOURS.len()];
            let span = [(x.round() as i32, 30), ((x + width).round() as i32, 60)];
            root.draw(&Rectangle::new(span, RGBColor(r, g, b).filled()))
                .expect(INTO_STRING);
            x += width;
        }
        for (i, c) in s.classes.iter().enumerate() {
            let lx = 40 + 86 * i as i32;
            let (r, g, b) = COLOURS[i % COLOURS.len()];
            root.draw(&Rectangle::new([(lx, 80), (lx + 10, 90)], RGBColor(r, g, b).filled()))
                .expect(INTO_STRING);
            let label = format!("{} ({})", c.class, c.count);
            root.draw(&Text::new(label, (lx + 14, 80), ("sans-serif", 11)))
                .expect(INTO_STRING);
        }
        root.present().expect(INTO_STRING);
    }
    out
}

/// Writes summary.json, summary.md and summary.svg into `dir`.
pub fn write_all(dir: &Path, s: &Summary) -> std::io::Result<()> {
    std::fs::write(
        dir.join("summary.json"),
        serde_json::to_string_pretty(s).expect("serialise") + "\n",
    )?;
    std::fs::write(dir.join("summary.md"), markdown(s))?;
    std::fs::write(dir.join("summary.svg"), svg(s))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn row(class: &'static str, count: u64) -> ClassRow {
        ClassRow {
            class,
            count,
            percent: None,
            interval_low: None,
            interval_high: None,
        }
    }

    /// The bar has one segment per class that occurred, widths in proportion; the legend
    /// names every class with its count.
    #[test]
    fn the_chart_has_a_segment_per_class_seen_and_a_full_legend() {
        let s = Summary {
            command: vec!["prog".into()],
            model: "reg".into(),
            runs: 100,
            activated: 90,
            confidence: 95.0,
            classes: vec![row("masked", 75), row("detected", 0), row("sdc", 25)],
            sdc_upper_bound: None,
            throughput: None,
        };
        let svg = svg(&s);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"), "{svg}");
        assert!(svg.contains("reg faults, 100 runs"));
        for label in ["masked (75)", "detected (0)", "sdc (25)"] {
            assert!(svg.contains(label), "{label} missing:\n{svg}");
        }
        // white background + 2 segments + 3 legend swatches
        assert_eq!(svg.matches("<rect").count(), 6, "{svg}");
        assert!(svg.contains(r#"x="40" y="30" width="420" height="30""#), "{svg}");
        assert!(svg.contains(r#"x="460" y="30" width="140" height="30""#), "{svg}");
    }
}
