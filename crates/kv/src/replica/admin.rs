//! What a replica answers itself: `stats` and lockstep's own test commands.

use super::*;

impl Replica {
    /// `queued_behind`: replies to earlier requests of the connection are still queued.
    pub(super) fn local_command(&mut self, line: &str, queued_behind: bool) -> String {
        let words: Vec<&str> = line.split_whitespace().collect();
        match words[..] {
            ["lockstep_digest"] => {
                let (digest, bad) = self.store.digest();
                format!("DIGEST {digest:016x} {} {bad}\r\n", self.applied)
            }
            ["lockstep_corrupt", key, what, ref rest @ ..] if self.cfg.test_corruption => {
                let target = match what {
                    "item" => Target::Item,
                    "bucket" => Target::Bucket,
                    "links" => Target::Links,
                    _ => {
                        return "CLIENT_ERROR usage: lockstep_corrupt <key> item|bucket|links [recompute] [bit]\r\n"
                            .into()
                    }
                };
                let recompute = rest.contains(&"recompute");
                let bit = rest.iter().find_map(|w| w.parse::<u64>().ok()).unwrap_or(3);
                match self.store.corrupt(key.as_bytes(), target, bit, recompute) {
                    Some(id) => {
                        self.events.emit(
                            Event::new("kv", "inject", "flip")
                                .replica(self.cfg.id as u32)
                                .object(id.to_string())
                                .message(format!(
                                    "test corruption: flipped a bit of object {id} ({what} of {key:?}{})",
                                    if recompute { ", CRC recomputed" } else { "" }
                                )),
                        );
                        format!("CORRUPTED {id}\r\n")
                    }
                    None => "NOT_FOUND\r\n".into(),
                }
            }
            ["lockstep_isolate", ms] if self.cfg.test_corruption => match ms.parse::<u64>() {
                Ok(ms) if ms <= 60_000 => {
                    // A network partition around this replica: nothing to or from the
                    // other replicas for that long.
                    if let Some(r) = self.raft.as_mut() {
                        r.isolated_until = Some(Instant::now() + Duration::from_millis(ms));
                    }
                    "OK\r\n".into()
                }
                _ => "CLIENT_ERROR usage: lockstep_isolate <milliseconds, at most 60000>\r\n".into(),
            },
            ["lru_crawler", ref args @ ..] => self.lru_crawler(args, queued_behind),
            ["lockstep_corrupt" | "lockstep_isolate", ..] => {
                "CLIENT_ERROR test commands are off (start the replica with --test-corruption)\r\n".into()
            }
            _ => "ERROR\r\n".into(),
        }
    }

    /// memcached's `lru_crawler`. kv has no crawler thread: expired items are reclaimed
    /// as they are met, so `crawl` has nothing to add; `enable`/`disable` keep memcached's
    /// state and replies, and `metadump` lists the live items.
    fn lru_crawler(&mut self, args: &[&str], queued_behind: bool) -> String {
        const DISABLED: &str = "CLIENT_ERROR lru crawler disabled\r\n";
        // memcached's class ids: 1 to 62, or "all" (and "hash" for metadump).
        let classes = |spec: &str| -> Result<Option<Vec<u32>>, ()> {
            if spec == "all" || spec == "hash" {
                return Ok(None);
            }
            spec.split(',')
                .map(|p| p.parse::<u32>().ok().filter(|c| (1..=62).contains(c)).ok_or(()))
                .collect::<Result<Vec<_>, _>>()
                .map(Some)
        };
        let number = |n: &str| n.parse::<u32>().ok();
        match args {
            ["enable"] if self.crawler_enabled => "ERROR failed to start lru crawler thread\r\n".into(),
            ["enable"] => {
                self.crawler_enabled = true;
                "OK\r\n".into()
            }
            ["disable"] => {
                self.crawler_enabled = false;
                "OK\r\n".into()
            }
            ["sleep", n] => match number(n) {
                Some(n) if n <= 1_000_000 => "OK\r\n".into(),
                Some(_) => "CLIENT_ERROR sleep must be one second or less\r\n".into(),
                None => "CLIENT_ERROR bad command line format\r\n".into(),
            },
            ["tocrawl", n] => match number(n) {
                Some(_) => "OK\r\n".into(),
                None => "CLIENT_ERROR bad command line format\r\n".into(),
            },
            ["crawl", _] | ["metadump", _] if !self.crawler_enabled => DISABLED.into(),
            ["crawl", spec] => match classes(spec) {
                Ok(_) => "OK\r\n".into(),
                Err(()) => "BADCLASS invalid class id\r\n".into(),
            },
            ["metadump", _] if queued_behind => "ERROR cannot pipeline other commands before metadump\r\n".into(),
            ["metadump", spec] => match classes(spec) {
                Ok(which) => self.store.metadump(which.as_deref()) + "END\r\n",
                Err(()) => "BADCLASS invalid class id\r\n".into(),
            },
            _ => "ERROR\r\n".into(),
        }
    }

    pub(super) fn stats(&mut self, args: &[String]) -> Vec<u8> {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        match args[..] {
            [] | ["kv"] => {}
            ["settings"] => return self.settings(),
            ["items"] => {
                let g = self.store.stats();
                let mut out = String::new();
                if g.items > 0 {
                    out.push_str(&format!("STAT items:1:number {}\r\n", g.items));
                    out.push_str(&format!("STAT items:1:evicted {}\r\n", g.evictions));
                }
                out.push_str("END\r\n");
                return out.into_bytes();
            }
            ["slabs"] => {
                let g = self.store.stats();
                let active = u64::from(g.items > 0);
                return format!(
                    "STAT active_slabs {active}\r\nSTAT total_malloced {}\r\nEND\r\n",
                    g.bytes
                )
                .into_bytes();
            }
            ["sizes"] => return b"STAT sizes_status disabled\r\nEND\r\n".to_vec(),
            ["conns"] | ["detail", "dump"] => return b"END\r\n".to_vec(),
            ["detail", "on"] | ["detail", "off"] => return b"OK\r\n".to_vec(),
            ["reset"] => {
                // Statistics only: protected state and the kv_ counters are kept.
                let c = &mut self.counters;
                (
                    c.cmd_get,
                    c.cmd_set,
                    c.get_hits,
                    c.get_misses,
                    c.total_items,
                    c.total_connections,
                ) = (0, 0, 0, 0, 0, 0);
                return b"RESET\r\n".to_vec();
            }
            _ => return b"ERROR\r\n".to_vec(),
        }
        let mut out = String::new();
        let mut stat = |k: &str, v: String| out.push_str(&format!("STAT {k} {v}\r\n"));
        let g = self.store.stats();
        let c = &self.counters;
        {
            if args.is_empty() {
                stat("pid", std::process::id().to_string());
                stat("uptime", self.started.elapsed().as_secs().to_string());
                stat("time", (now_ms() / 1000).to_string());
                stat("version", env!("CARGO_PKG_VERSION").to_string());
                stat("pointer_size", (8 * std::mem::size_of::<usize>()).to_string());
                stat("threads", self.threads.to_string());
                stat("max_connections", self.cfg.max_conns.to_string());
                stat("curr_connections", c.curr_connections.to_string());
                stat("total_connections", c.total_connections.to_string());
                stat("cmd_get", c.cmd_get.to_string());
                stat("cmd_set", c.cmd_set.to_string());
                stat("get_hits", c.get_hits.to_string());
                stat("get_misses", c.get_misses.to_string());
                stat("curr_items", g.items.to_string());
                stat("total_items", c.total_items.to_string());
                stat("bytes", g.bytes.to_string());
                stat("limit_maxbytes", self.store.memory_limit().to_string());
                stat("evictions", g.evictions.to_string());
                let (power, bytes) = self.store.hash_size();
                stat("hash_power_level", power.to_string());
                stat("hash_bytes", bytes.to_string());
                stat("hash_is_expanding", "0".into());
            }
            let role = match &self.raft {
                None => "single".to_string(),
                Some(r) => match r.node.raft.state {
                    StateRole::Leader => "leader".into(),
                    StateRole::Follower => "follower".into(),
                    _ => "candidate".into(),
                },
            };
            stat("kv_mode", self.cfg.mode.name().into());
            stat("kv_replica", self.cfg.id.to_string());
            stat("kv_role", role);
            // The replicas this one counts as voters (after a replacement: back to all).
            let voters = self
                .raft
                .as_ref()
                .map_or(0, |r| r.node.raft.prs().conf().to_conf_state().voters.len());
            stat("kv_voters", voters.to_string());
            let messages = self.raft.as_ref().map_or(0, |r| r.messages_sent);
            stat("kv_raft_messages", messages.to_string());
            stat("kv_allocations", lockstep_core::alloc_count::allocations().to_string());
            stat("kv_applied", self.applied.to_string());
            stat("kv_requests", c.requests.to_string());
            stat("kv_detections", c.self_detections.to_string());
            stat("kv_divergences", c.divergences.to_string());
            stat("kv_recoveries", c.recoveries.to_string());
            stat("kv_false_positives", c.false_positives.to_string());
            stat("kv_repair_objects", c.repair_objects.to_string());
            stat("kv_repair_bytes", c.repair_bytes.to_string());
            stat("kv_last_recovery_us", c.last_recovery_us.to_string());
            stat("kv_max_recovery_us", c.max_recovery_us.to_string());
            stat("kv_held_dropped", c.held_dropped.to_string());
            stat("kv_order_timeouts", c.order_timeouts.to_string());
            stat("kv_replacements", c.replacements.to_string());
            stat("kv_no_majority", c.no_majority.to_string());
            stat("kv_audits", self.audits.audits.to_string());
            stat("kv_audit_divergent_groups", self.audits.divergent_groups.to_string());
            stat("kv_audit_last_us", self.audits.last_us.to_string());
            stat("kv_audit_max_us", self.audits.max_us.to_string());
            stat("kv_confirmed_snapshots", self.audits.confirmed_snapshots.to_string());
            stat(
                "kv_pending_validation",
                self.validator.as_ref().map_or(0, |v| v.pending()).to_string(),
            );
        }
        out.push_str("END\r\n");
        out.into_bytes()
    }

    /// `stats settings`: memcached's names, for what applies here.
    fn settings(&self) -> Vec<u8> {
        let limits = self.store.limits();
        let mut out = String::new();
        for (k, v) in [
            ("maxbytes", self.store.memory_limit().to_string()),
            ("maxconns", self.cfg.max_conns.to_string()),
            ("tcpport", self.cfg.client.port().to_string()),
            ("udpport", "0".into()),
            ("inter", self.cfg.client.ip().to_string()),
            ("evictions", "on".into()),
            ("num_threads", self.threads.to_string()),
            ("cas_enabled", "yes".into()),
            ("binding_protocol", "ascii".into()),
            ("item_size_max", limits.item_max.to_string()),
            ("maxconns_fast", "yes".into()),
            ("tcp_backlog", "1024".into()),
            ("flush_enabled", "yes".into()),
            ("shutdown_command", "no".into()),
            ("detail_enabled", "no".into()),
        ] {
            out.push_str(&format!("STAT {k} {v}\r\n"));
        }
        out.push_str("END\r\n");
        out.into_bytes()
    }
}
