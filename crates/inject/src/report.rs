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

const COLOURS: [&str; 7] = [
    "#4caf50", "#2196f3", "#ff9800", "#9c27b0", "#795548", "#f44336", "#bdbdbd",
];

/// One stacked horizontal bar: the share of each class among all runs.
pub fn svg(s: &Summary) -> String {
    let (w, h, bar) = (640.0, 120.0, 560.0);
    let mut out = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n");
    out.push_str(&format!(
        "<text x=\"40\" y=\"18\" font-size=\"13\">{} faults, {} runs</text>\n",
        s.model, s.runs
    ));
    let mut x = 40.0;
    for (i, c) in s.classes.iter().enumerate() {
        if c.count == 0 || s.runs == 0 {
            continue;
        }
        let width = bar * c.count as f64 / s.runs as f64;
        out.push_str(&format!(
            "<rect x=\"{x:.1}\" y=\"30\" width=\"{width:.1}\" height=\"30\" fill=\"{}\"><title>{}: {}</title></rect>\n",
            COLOURS[i], c.class, c.count
        ));
        x += width;
    }
    let mut lx = 40.0;
    for (i, c) in s.classes.iter().enumerate() {
        out.push_str(&format!("<rect x=\"{lx}\" y=\"80\" width=\"10\" height=\"10\" fill=\"{}\"/><text x=\"{}\" y=\"89\">{} ({})</text>\n", COLOURS[i], lx + 14.0, c.class, c.count));
        lx += 86.0;
    }
    out.push_str("</svg>\n");
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
