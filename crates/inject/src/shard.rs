//! Campaigns split over machines. `--shard K/N` runs the K-th of N disjoint slices of a
//! campaign: run r belongs to shard r mod N, and its seed, point and fault are those of run
//! r in the whole campaign (they depend only on the campaign seed and r). Each output
//! directory holds a `campaign.json` whose id hashes what makes two invocations the same
//! campaign; [`merge`] joins shard directories into one and refuses shards of different
//! campaigns.

use crate::campaign::{Config, Record};
use crate::classify::Golden;
use lockstep_core::signature::Signature;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The most shards a campaign may be split into.
pub const SHARDS_MAX: u64 = 100_000;

/// Files named on the command line larger than this are identified by size and name only.
const HASHED_FILE_MAX: u64 = 256 << 20;

/// Which slice of a campaign this invocation runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Shard {
    pub index: u64,
    pub count: u64,
}

impl Shard {
    /// Whether run `run` belongs to this shard.
    pub fn owns(&self, run: u64) -> bool {
        run % self.count == self.index
    }

    /// The number of runs of a `runs`-run campaign that fall in this shard.
    pub fn runs_of(&self, runs: u64) -> u64 {
        runs / self.count + u64::from(runs % self.count > self.index)
    }
}

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::str::FromStr for Shard {
    type Err = String;
    fn from_str(s: &str) -> Result<Shard, String> {
        let bad = || format!("bad --shard '{s}': expected K/N with 0 <= K < N <= {SHARDS_MAX} (for example 0/4)");
        let (k, n) = s.split_once('/').ok_or_else(bad)?;
        let (index, count): (u64, u64) = (k.parse().map_err(|_| bad())?, n.parse().map_err(|_| bad())?);
        if count == 0 || count > SHARDS_MAX || index >= count {
            return Err(bad());
        }
        Ok(Shard { index, count })
    }
}

/// `campaign.json`: what an output directory holds results of.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CampaignFile {
    /// 16 hex digits; equal for every shard of one campaign (see [`campaign_id`]).
    pub id: String,
    pub command: Vec<String>,
    pub fault: String,
    pub runs: u64,
    pub seed: u64,
    pub confidence: f64,
    /// None: the whole campaign (or a merge of all its shards).
    pub shard: Option<Shard>,
}

impl CampaignFile {
    pub const NAME: &'static str = "campaign.json";

    pub fn read(dir: &Path) -> Result<CampaignFile, String> {
        let path = dir.join(Self::NAME);
        let text = std::fs::read_to_string(&path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        serde_json::from_str(&text).map_err(|e| format!("{} is not a campaign file: {e}", path.display()))
    }

    pub fn write(&self, dir: &Path) -> std::io::Result<()> {
        let text = serde_json::to_string_pretty(self).expect("serialise") + "\n";
        std::fs::write(dir.join(Self::NAME), text)
    }
}

/// The identity of a campaign: the command as given (before `{dir}` and `{port}` are
/// expanded), the contents of every file it names, the fault model and its options, the
/// seed, the compared channels, the hang timeout the user gave, the server client and the
/// golden outputs. Not in it: the number of runs (a campaign may be extended), the workers,
/// the ports and the output directory.
pub fn campaign_id(cfg: &Config, fault: &str, golden: &Golden) -> String {
    let mut sig = Signature::new();
    let fold_str = |sig: &mut Signature, s: &str| {
        sig.begin_event();
        sig.fold_bytes(s.as_bytes());
    };
    for arg in &cfg.argv {
        fold_str(&mut sig, arg);
        fold_file(&mut sig, Path::new(arg));
    }
    let options = format!(
        "{fault}|{:?}|{:?}|{}|{:?}|{:?}|{}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}|{:?}",
        cfg.width,
        cfg.scope.region,
        cfg.scope.libs,
        cfg.scope.pid_filter,
        cfg.at,
        cfg.seed,
        cfg.timeout,
        cfg.compare.stdout,
        cfg.compare.stderr,
        cfg.compare.exit,
        cfg.compare.files,
        cfg.compare.diff_cmd,
        cfg.replica,
        cfg.server.as_ref().map(|s| &s.client),
    );
    fold_str(&mut sig, &options);
    fold_str(&mut sig, &format!("{:?}", golden.ending));
    sig.fold_bytes(&golden.stdout);
    sig.fold_bytes(&golden.stderr);
    for f in &golden.files {
        sig.begin_event();
        sig.fold_bytes(f.as_deref().unwrap_or(b"\xff(absent)"));
    }
    format!("{:016x}", sig.digest() ^ sig.events.rotate_left(48))
}

/// Folds the contents of `path` if it names a regular file (the program, a script, an
/// input): a shard run against another build or other data is another campaign.
fn fold_file(sig: &mut Signature, path: &Path) {
    use std::io::Read;
    let Ok(meta) = std::fs::metadata(path) else {
        return;
    };
    if !meta.is_file() {
        return;
    }
    sig.fold_u64(meta.len());
    if meta.len() > HASHED_FILE_MAX {
        return;
    }
    let Ok(mut f) = std::fs::File::open(path) else {
        return;
    };
    let mut crc = 0u32;
    let mut buf = vec![0u8; 1 << 16];
    while let Ok(n) = f.read(&mut buf) {
        if n == 0 {
            break;
        }
        crc = lockstep_core::checksum::crc32c_append(crc, &buf[..n]);
    }
    sig.fold_u32(crc);
}

/// What [`merge`] joined.
pub struct Merged {
    pub campaign: CampaignFile,
    pub records: Vec<Record>,
    /// Shard numbers of the campaign that were not among the inputs.
    pub missing_shards: Vec<u64>,
}

/// Joins the results of shard directories `dirs` (each with its `campaign.json` and
/// `results.jsonl`). Refuses directories of different campaigns, shards of different
/// splits, the same shard twice, and records that do not belong to their shard.
pub fn merge(dirs: &[PathBuf]) -> Result<Merged, String> {
    if dirs.is_empty() {
        return Err("merge needs at least one shard directory".into());
    }
    let mut first: Option<(CampaignFile, &Path)> = None;
    let mut seen: BTreeMap<u64, &Path> = BTreeMap::new();
    let mut records: BTreeMap<u64, Record> = BTreeMap::new();
    let mut count = None;
    for dir in dirs {
        let c = CampaignFile::read(dir)?;
        if let Some((f, fdir)) = &first {
            if c.id != f.id {
                return Err(format!(
                    "{} holds campaign {} but {} holds campaign {}: shards of different campaigns (command, fault options, seed, program files or golden output differ) cannot be merged",
                    dir.display(),
                    c.id,
                    fdir.display(),
                    f.id
                ));
            }
            if c.runs != f.runs {
                return Err(format!(
                    "{} was run with --runs {} but {} with --runs {}",
                    dir.display(),
                    c.runs,
                    fdir.display(),
                    f.runs
                ));
            }
        }
        let shard = c.shard.unwrap_or(Shard { index: 0, count: 1 });
        match count {
            None => count = Some(shard.count),
            Some(n) if n != shard.count => {
                return Err(format!(
                    "{} is shard {shard}, but an earlier directory belongs to a split into {n}",
                    dir.display()
                ))
            }
            Some(_) => {}
        }
        if let Some(other) = seen.insert(shard.index, dir) {
            return Err(format!(
                "{} and {} are both shard {shard}",
                other.display(),
                dir.display()
            ));
        }
        for rec in crate::campaign::load_results(&dir.join("results.jsonl")) {
            if !shard.owns(rec.run) || rec.run >= c.runs {
                return Err(format!(
                    "{}: run {} does not belong to shard {shard} of a {}-run campaign",
                    dir.display(),
                    rec.run,
                    c.runs
                ));
            }
            records.insert(rec.run, rec);
        }
        if first.is_none() {
            first = Some((c, dir));
        }
    }
    let (mut campaign, _) = first.expect("at least one directory");
    let count = count.expect("at least one directory");
    let missing_shards = (0..count).filter(|k| !seen.contains_key(k)).collect();
    campaign.shard = None;
    Ok(Merged {
        campaign,
        records: records.into_values().collect(),
        missing_shards,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shards_parse_and_partition_the_runs() {
        assert_eq!("0/1".parse::<Shard>().unwrap(), Shard { index: 0, count: 1 });
        for bad in ["", "1", "1/1", "3/2", "-1/2", "0/0", "a/b", "0/100001", "1/2/3"] {
            assert!(bad.parse::<Shard>().is_err(), "{bad}");
        }
        for runs in [0u64, 1, 7, 100, 1001] {
            for count in 1..6 {
                let shards: Vec<Shard> = (0..count).map(|index| Shard { index, count }).collect();
                let total: u64 = shards.iter().map(|s| s.runs_of(runs)).sum();
                assert_eq!(total, runs);
                for run in 0..runs {
                    assert_eq!(shards.iter().filter(|s| s.owns(run)).count(), 1);
                }
                for s in &shards {
                    assert_eq!(s.runs_of(runs), (0..runs).filter(|&r| s.owns(r)).count() as u64);
                }
            }
        }
    }
}
