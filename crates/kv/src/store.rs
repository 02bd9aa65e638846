//! The key-value store: memcached semantics over protected objects. Execution is a pure
//! function of (state, command, log time), so every replica that applies the same log
//! reaches the same state and the same replies. Every object access goes through its guard
//! and lands in the request's [`Delta`].

use crate::buffers::{refill, Buffers};
use crate::command::{Command, StoreOp};
use crate::objects::*;
use lockstep_guard::{Corrupt, Delta, Guarded, ObjectId, Packer, Protected, UnpackError, Unpacker};
use std::collections::BTreeSet;
use std::io::Write as _;
use std::ops::Range;

/// Recorded for an object that a request deleted.
pub const GONE: u32 = 0;

/// memcached: exptimes up to 30 days are relative, larger ones are Unix times.
const RELATIVE_EXPTIME_MAX: i64 = 60 * 60 * 24 * 30;
/// An item's LRU position is refreshed at most this often (as memcached does).
const LRU_BUMP_INTERVAL_MS: u64 = 60_000;

#[derive(Clone, Debug)]
pub struct Limits {
    /// Buckets in the hash index (fixed: the index never rehashes, so ids stay stable).
    pub buckets: u32,
    /// Memory for items (key + value + overhead) before LRU eviction.
    pub memory_bytes: u64,
    /// Largest value accepted.
    pub item_max: usize,
}

/// Memory per bucket of the hash index: the index is sized once, from the memory limit,
/// so that a full store of small items (about 500 bytes each) has about two per bucket.
/// A fixed count made every lookup of a large store check and scan a long bucket:
/// 128 entries at 1 GiB.
const BYTES_PER_BUCKET: u64 = 1024;
/// Bucket counts are powers of two between these (memcached's default hash power, 16,
/// is where 64 MiB lands).
const BUCKETS_MIN: u32 = 1 << 12;
const BUCKETS_MAX: u32 = 1 << 24;

impl Limits {
    /// Limits for a store of `memory_bytes`, with a hash index sized for it.
    pub fn new(memory_bytes: u64, item_max: usize) -> Self {
        let wanted = (memory_bytes / BYTES_PER_BUCKET).clamp(BUCKETS_MIN.into(), BUCKETS_MAX.into());
        Limits {
            buckets: (wanted as u32).next_power_of_two(),
            memory_bytes,
            item_max,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Limits::new(64 << 20, 1 << 20)
    }
}

pub struct Store {
    limits: Limits,
    items: Vec<Option<Guarded<Item>>>,
    links: Vec<Option<Guarded<Links>>>,
    buckets: Vec<Guarded<Bucket>>,
    slab: Guarded<Slab>,
    free_chunks: Vec<Option<Guarded<FreeChunk>>>,
    globals: Guarded<Globals>,
    /// Buffers of items that are gone, for the next items' keys and values.
    spare: Buffers,
}

type R<T> = Result<T, Corrupt>;

/// Which object a test-only corruption hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The item holding a key (its value).
    Item,
    /// The hash-index bucket of a key.
    Bucket,
    /// The LRU/expiry links of a key's item.
    Links,
}

impl Store {
    pub fn new(limits: Limits) -> Self {
        assert!(limits.buckets > 0 && limits.buckets.is_power_of_two());
        let buckets = (0..limits.buckets)
            .map(|b| Guarded::restore(bucket_id(b), Bucket::default()))
            .collect();
        Store {
            limits,
            items: Vec::new(),
            links: Vec::new(),
            buckets,
            slab: Guarded::restore(SLAB_ID, Slab::default()),
            free_chunks: Vec::new(),
            globals: Guarded::restore(GLOBALS_ID, Globals::default()),
            spare: Buffers::default(),
        }
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    /// The memory limit in force: `cache_memlimit`'s, or the configured one.
    pub fn memory_limit(&self) -> u64 {
        memory_limit(&self.limits, self.globals.peek())
    }

    /// The hash index's size as memcached's stats show it: log2 of the bucket count, and
    /// the bytes of the bucket array (without the buckets' entries).
    pub fn hash_size(&self) -> (u32, usize) {
        (
            self.limits.buckets.trailing_zeros(),
            self.buckets.len() * std::mem::size_of::<Guarded<Bucket>>(),
        )
    }

    /// Execute one command at log time `now_ms`. The reply is recorded in the delta. On a
    /// failed object check the command stops where it is; the reply is then an error that
    /// no client must see (the cross-check will disagree with it), and the delta names the
    /// object.
    /// A store command's value is copied into the item, into a buffer of an item that is
    /// gone where the store has one (`Buffers`): the command stays as it was, for its
    /// buffers to serve the next command decoded.
    pub fn apply(&mut self, cmd: &Command, now_ms: u64, delta: &mut Delta) -> Vec<u8> {
        let mut reply = Vec::new();
        self.apply_into(cmd, now_ms, delta, &mut reply);
        reply
    }

    /// [`Store::apply`], the reply written into `reply` (emptied first): a replica that
    /// sends no reply for a request reuses one buffer for all of them.
    pub fn apply_into(&mut self, cmd: &Command, now_ms: u64, delta: &mut Delta, reply: &mut Vec<u8>) {
        reply.clear();
        self.apply_append(cmd, now_ms, delta, reply);
    }

    /// [`Store::apply`], the reply appended to `out` (which may hold other replies):
    /// returns where in `out` it is. The replies a cross-checking replica keeps for an
    /// entry share one buffer this way.
    pub fn apply_append(&mut self, cmd: &Command, now_ms: u64, delta: &mut Delta, out: &mut Vec<u8>) -> Range<usize> {
        let start = out.len();
        let result = self
            .advance_clock(now_ms, delta)
            .and_then(|now| self.execute(cmd, now, delta, out));
        if let Err(c) = result {
            out.truncate(start);
            out.extend_from_slice(format!("SERVER_ERROR {c}\r\n").as_bytes());
        }
        delta.record_reply(&out[start..]);
        start..out.len()
    }

    fn advance_clock(&mut self, now_ms: u64, delta: &mut Delta) -> R<u64> {
        let g = self.globals.read(delta)?;
        if now_ms <= g.now_ms {
            return Ok(g.now_ms);
        }
        self.globals.write(delta)?.now_ms = now_ms;
        Ok(now_ms)
    }

    fn execute(&mut self, cmd: &Command, now: u64, d: &mut Delta, out: &mut Vec<u8>) -> R<()> {
        match cmd {
            Command::Get { keys, with_cas, touch } => {
                for key in keys {
                    let Some(slot) = self.lookup(key, now, d)? else {
                        continue;
                    };
                    if let Some(exptime) = touch {
                        let exp = absolute_exptime(*exptime, now);
                        self.item_mut(slot, d)?.exptime_ms = exp;
                    }
                    self.bump(slot, now, Fetched::Yes, d)?;
                    let it = self.item(slot, d)?;
                    // Header digits are at most 60 bytes; one reservation covers the value.
                    out.reserve(it.key.len() + it.value.len() + 80);
                    out.extend_from_slice(b"VALUE ");
                    out.extend_from_slice(&it.key);
                    // (Writing into a Vec cannot fail.)
                    let _ = write!(out, " {} {}", it.flags, it.value.len());
                    if *with_cas {
                        // (writing into a Vec cannot fail)
                        let _ = write!(out, " {}", it.cas);
                    }
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(&it.value);
                    out.extend_from_slice(b"\r\n");
                }
                out.extend_from_slice(b"END\r\n");
            }
            Command::Store {
                op,
                key,
                flags,
                exptime,
                data,
                cas,
            } => {
                let reply = self.store(*op, key, *flags, *exptime, data, *cas, MetaStore::default(), now, d)?;
                out.extend_from_slice(reply);
            }
            Command::Delete { key } => match self.lookup(key, now, d)? {
                Some(slot) => {
                    self.unlink(slot, d)?;
                    out.extend_from_slice(b"DELETED\r\n");
                }
                None => out.extend_from_slice(b"NOT_FOUND\r\n"),
            },
            Command::OnHeldItem(inner) => match &**inner {
                Command::Arith { key, incr, delta } => self.incr_or_decr(key, *incr, *delta, Held::Yes, now, d, out)?,
                Command::Meta { kind, key, flags, data } => {
                    self.meta(*kind, key, flags, data, Held::Yes, now, d, out)?
                }
                // (decode refuses any other)
                _ => out.extend_from_slice(b"SERVER_ERROR held-item command that is not arithmetic\r\n"),
            },
            Command::Arith { key, incr, delta } => self.incr_or_decr(key, *incr, *delta, Held::No, now, d, out)?,
            Command::Meta { kind, key, flags, data } => self.meta(*kind, key, flags, data, Held::No, now, d, out)?,
            Command::TooLarge { key } => {
                if let Some(slot) = self.lookup(key, now, d)? {
                    self.unlink(slot, d)?;
                }
                out.extend_from_slice(b"SERVER_ERROR object too large for cache\r\n");
            }
            Command::Touch { key, exptime } => match self.lookup(key, now, d)? {
                Some(slot) => {
                    self.item_mut(slot, d)?.exptime_ms = absolute_exptime(*exptime, now);
                    self.bump(slot, now, Fetched::Yes, d)?;
                    out.extend_from_slice(b"TOUCHED\r\n");
                }
                None => out.extend_from_slice(b"NOT_FOUND\r\n"),
            },
            Command::FlushAll { delay } => {
                // Now: every item stored so far (a CAS below the next one) is dead, exactly
                // in log order however many requests share a millisecond. Later: every item
                // stored up to that log time.
                let mut g = self.globals.write(d)?;
                if *delay > 0 {
                    g.oldest_live_ms = absolute_exptime(*delay, now);
                } else {
                    g.oldest_cas = g.cas + 1;
                }
                out.extend_from_slice(b"OK\r\n");
            }
            Command::MemLimit { mb } => {
                let bytes = u64::from(*mb) << 20;
                if bytes > self.limits.memory_bytes {
                    // The configured limit bounds what this process may allocate.
                    out.extend_from_slice(b"MEMLIMIT_ADJUST_FAILED out of bounds or unable to adjust\r\n");
                } else {
                    self.globals.write(d)?.memlimit = bytes;
                    // Like memcached, items are evicted as later stores need room.
                    out.extend_from_slice(b"OK\r\n");
                }
            }
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn store(
        &mut self,
        op: StoreOp,
        key: &[u8],
        flags: u32,
        exptime: i64,
        data: &[u8],
        cas_in: u64,
        how: MetaStore,
        now: u64,
        d: &mut Delta,
    ) -> R<&'static [u8]> {
        // As memcached: an append or prepend makes a new item that does not keep the flag.
        let key_binary = how.key_binary && !matches!(op, StoreOp::Append | StoreOp::Prepend);
        let existing = self.lookup(key, now, d)?;
        // `ms … I` with a CAS older than the item's: stored, but marked stale, keeping the
        // item's time to live and recache token (memcached's CAS_STALE).
        let mut stale_from = None;
        let exp = absolute_exptime(exptime, now);
        match (op, existing) {
            (StoreOp::Add, Some(slot)) => {
                self.bump(slot, now, Fetched::Unchanged, d)?;
                return Ok(b"NOT_STORED\r\n");
            }
            (StoreOp::Replace | StoreOp::Append | StoreOp::Prepend, None) => return Ok(b"NOT_STORED\r\n"),
            (StoreOp::Cas, None) => return Ok(b"NOT_FOUND\r\n"),
            (StoreOp::Cas, Some(slot)) => {
                let old = self.item(slot, d)?;
                if old.cas != cas_in {
                    if !(how.set_stale && cas_in != 0 && cas_in < old.cas) {
                        return Ok(b"EXISTS\r\n");
                    }
                    stale_from = Some((old.exptime_ms, old.token_sent));
                }
            }
            _ => {}
        }
        if let Some(slot) = existing {
            if matches!(op, StoreOp::Append | StoreOp::Prepend)
                && self.item(slot, d)?.value.len() + data.len() > self.limits.item_max
            {
                return Ok(b"SERVER_ERROR object too large for cache\r\n");
            }
        }
        let cas = self.next_cas(d)?;
        let stored_ms = now;
        match existing {
            Some(slot) => {
                let old_size = {
                    let mut it = self.item_mut(slot, d)?;
                    let old = it.size();
                    match op {
                        StoreOp::Append => it.value.extend_from_slice(data),
                        StoreOp::Prepend => {
                            it.value.splice(0..0, data.iter().copied());
                        }
                        _ => {
                            refill(&mut it.value, data);
                            it.flags = flags;
                            it.exptime_ms = exp;
                        }
                    }
                    it.cas = cas;
                    it.stored_ms = stored_ms;
                    // A store makes a new item in memcached: no marks but the key's.
                    it.key_binary = key_binary;
                    (it.stale, it.token_sent) = (false, false);
                    if let Some((exptime_ms, token_sent)) = stale_from {
                        (it.exptime_ms, it.stale, it.token_sent) = (exptime_ms, true, token_sent);
                    }
                    old
                };
                self.account(old_size, slot, d)?;
                // memcached stores a new item: not fetched yet.
                self.bump(slot, now, Fetched::No, d)?;
            }
            None => {
                let item = Item {
                    key: self.spare.copy(key),
                    value: self.spare.copy(data),
                    flags,
                    exptime_ms: exp,
                    cas,
                    stored_ms,
                    key_binary,
                    stale: false,
                    token_sent: false,
                };
                self.link(item, now, d)?;
            }
        }
        Ok(b"STORED\r\n")
    }

    /// Text incr/decr.
    #[allow(clippy::too_many_arguments)]
    fn incr_or_decr(
        &mut self,
        key: &[u8],
        incr: bool,
        delta: u64,
        held: Held,
        now: u64,
        d: &mut Delta,
        out: &mut Vec<u8>,
    ) -> R<()> {
        let Some(slot) = self.lookup(key, now, d)? else {
            out.extend_from_slice(b"NOT_FOUND\r\n");
            return Ok(());
        };
        match self.arith(slot, incr, delta, held, d)? {
            Some(digits) => {
                out.extend_from_slice(&digits);
                out.extend_from_slice(b"\r\n");
            }
            None => out.extend_from_slice(NON_NUMERIC),
        }
        Ok(())
    }

    /// incr/decr on the item in `slot`: its new value as digits, or None if it does not
    /// hold a number. The value is rewritten in place and padded with spaces when it still
    /// fits, as memcached does ("100" decremented by 1 reads "99 "); otherwise, or when the
    /// item is `held`, memcached makes a new item (unpadded, not fetched, without a base64
    /// key's mark), and so does this.
    fn arith(&mut self, slot: u32, incr: bool, delta: u64, held: Held, d: &mut Delta) -> R<Option<Vec<u8>>> {
        let Some(current) = parse_counter(&self.item(slot, d)?.value) else {
            return Ok(None);
        };
        let new = if incr {
            current.wrapping_add(delta)
        } else {
            current.saturating_sub(delta)
        };
        let digits = new.to_string().into_bytes();
        let cas = self.next_cas(d)?;
        let (old_size, new_item) = {
            let mut it = self.item_mut(slot, d)?;
            let old = it.size();
            let mut value = digits.clone();
            let new_item = held == Held::Yes || value.len() > it.value.len();
            if new_item {
                (it.key_binary, it.stale, it.token_sent) = (false, false, false);
            } else {
                value.resize(it.value.len(), b' ');
            }
            it.value = value;
            it.cas = cas;
            (old, new_item)
        };
        if new_item && self.links_of(slot, d)?.fetched {
            self.links_mut(slot, d)?.fetched = false;
        }
        self.account(old_size, slot, d)?;
        Ok(Some(digits))
    }

    /// The meta commands: mg, ms, md, ma and me, with the flags `meta_flags` allows.
    #[allow(clippy::too_many_arguments)]
    fn meta(
        &mut self,
        kind: u8,
        key: &[u8],
        flags: &[Vec<u8>],
        data: &[u8],
        held: Held,
        now: u64,
        d: &mut Delta,
        out: &mut Vec<u8>,
    ) -> R<()> {
        let flag = |c: u8| flags.iter().find(|f| f[0] == c).map(|f| &f[1..]);
        let number = |c: u8| flag(c).and_then(|a| std::str::from_utf8(a).ok()?.parse::<i64>().ok());
        let unsigned = |c: u8| flag(c).and_then(|a| std::str::from_utf8(a).ok()?.parse::<u64>().ok());
        let quiet = flag(b'q').is_some();
        // The return flags, in the order they were asked for.
        // `no_item_cas`: what `c` shows without an item (ms shows c0 when nothing was stored).
        // `before`: for mg, the item before this read (see `MgBefore`).
        let returned = |store: &Self,
                        slot: Option<u32>,
                        no_item_cas: Option<u64>,
                        before: Option<&MgBefore>,
                        d: &mut Delta|
         -> R<Vec<u8>> {
            let mut r = Vec::new();
            let it = match slot {
                Some(s) => Some(store.item(s, d)?),
                None => None,
            };
            for (at, f) in flags.iter().enumerate() {
                let shown = match (f[0], it) {
                    // An mg hit shows the item's key; everything else echoes the request's.
                    (b'k', Some(it)) if before.is_some() => shown_key(&it.key, it.key_binary),
                    (b'k', _) => shown_key(key, flag(b'b').is_some()),
                    (b'O', _) => f.clone(),
                    (b'c', Some(it)) => format!("c{}", it.cas).into_bytes(),
                    (b'c', None) if no_item_cas.is_some() => format!("c{}", no_item_cas.unwrap_or(0)).into_bytes(),
                    (b'f', Some(it)) => format!("f{}", it.flags).into_bytes(),
                    (b's', Some(it)) => format!("s{}", it.value.len()).into_bytes(),
                    (b't', Some(it)) => {
                        // memcached handles the flags in order: a `t` shows the time to
                        // live as the `T` or `N` ahead of it left it.
                        let exptime = match before {
                            Some(b) => b.exptime_after(&flags[..at], now),
                            None => it.exptime_ms,
                        };
                        format!("t{}", ttl_left(exptime, now)).into_bytes()
                    }
                    (b'h', Some(_)) if before.is_some() => {
                        format!("h{}", before.map_or(0, |b| b.links.fetched as u8)).into_bytes()
                    }
                    (b'l', Some(_)) if before.is_some() => {
                        let idle = now.saturating_sub(before.map_or(now, |b| b.links.accessed_ms)) / 1000;
                        format!("l{idle}").into_bytes()
                    }
                    _ => continue,
                };
                r.push(b' ');
                r.extend_from_slice(&shown);
            }
            Ok(r)
        };
        let slot = self.lookup(key, now, d)?;
        // A compare-and-swap token that does not match the item's CAS.
        let cas_mismatch = match (slot, unsigned(b'C')) {
            (Some(s), Some(c)) => self.item(s, d)?.cas != c,
            _ => false,
        };
        match kind {
            b'g' => {
                // N: a miss creates an empty item (without the base64 mark, as memcached)
                // whose reader gets the recache token; its time to live comes in flag
                // order below.
                let (slot, created) = match slot {
                    Some(s) => (Some(s), false),
                    None if flag(b'N').is_some() => {
                        self.store(StoreOp::Add, key, 0, 0, &[], 0, MetaStore::default(), now, d)?;
                        (self.lookup(key, now, d)?, true)
                    }
                    None => (None, false),
                };
                let Some(slot) = slot else {
                    if !quiet {
                        out.extend_from_slice(b"EN");
                        out.extend_from_slice(&returned(self, None, None, None, d)?);
                        out.extend_from_slice(b"\r\n");
                    }
                    return Ok(());
                };
                let before = MgBefore {
                    links: self.links_of(slot, d)?,
                    exptime_ms: self.item(slot, d)?.exptime_ms,
                    created,
                };
                let exptime = before.exptime_after(flags, now);
                if exptime != before.exptime_ms {
                    self.item_mut(slot, d)?.exptime_ms = exptime;
                }
                // The recache token (memcached's W, Z and X): N on a created item wins;
                // R wins when the time to live is below its argument and no reader holds
                // the token; a stale item hands it to its first reader.
                let it = self.item(slot, d)?;
                let recache = flags.iter().position(|f| f[0] == b'R').is_some_and(|at| {
                    let exptime = before.exptime_after(&flags[..at], now);
                    let below = meta_exptime(number(b'R').unwrap_or(0), now);
                    !created && exptime != 0 && below != 0 && ttl_left(exptime, now) < ttl_left(below, now)
                });
                let (held, stale) = (it.token_sent, it.stale);
                let won = created || (!held && (recache || stale));
                if won {
                    self.item_mut(slot, d)?.token_sent = true;
                }
                // u: the read leaves the item where it is in the LRU, and unfetched.
                if flag(b'u').is_none() {
                    self.bump(slot, now, Fetched::Yes, d)?;
                }
                let mut rest = returned(self, Some(slot), None, Some(&before), d)?;
                for (mark, on) in [(b" Z", held), (b" X", stale), (b" W", won)] {
                    if on {
                        rest.extend_from_slice(mark);
                    }
                }
                if flag(b'v').is_some() {
                    let it = self.item(slot, d)?;
                    out.extend_from_slice(format!("VA {}", it.value.len()).as_bytes());
                    out.extend_from_slice(&rest);
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(&it.value);
                    out.extend_from_slice(b"\r\n");
                } else {
                    out.extend_from_slice(b"HD");
                    out.extend_from_slice(&rest);
                    out.extend_from_slice(b"\r\n");
                }
            }
            b's' => {
                let op = match flag(b'M').and_then(|m| m.first()).map(u8::to_ascii_uppercase) {
                    Some(b'E') => StoreOp::Add,
                    Some(b'A') => StoreOp::Append,
                    Some(b'P') => StoreOp::Prepend,
                    // As memcached: replace with a CAS token is a CAS.
                    Some(b'R') if flag(b'C').is_none() => StoreOp::Replace,
                    _ if flag(b'C').is_some() => StoreOp::Cas,
                    _ => StoreOp::Set,
                };
                // A CAS token fails when the item has another CAS, and a replace or set
                // when it is missing (memcached: NF; add, append and prepend go on).
                let cas_failure: &[u8] = match (flag(b'C'), slot) {
                    (Some(_), None) if matches!(op, StoreOp::Replace | StoreOp::Set) => b"NF",
                    // (An add finds the item there whatever its CAS: NS.)
                    _ if cas_mismatch && op != StoreOp::Add => b"EX",
                    _ => b"",
                };
                if !cas_failure.is_empty() && op != StoreOp::Cas {
                    out.extend_from_slice(cas_failure);
                    out.extend_from_slice(&returned(self, None, Some(0), None, d)?);
                    out.extend_from_slice(b"\r\n");
                    return Ok(());
                }
                let item_flags = unsigned(b'F').unwrap_or(0) as u32;
                let ttl = number(b'T').unwrap_or(0) as i32 as i64;
                let cas_in = unsigned(b'C').unwrap_or(0);
                let how = MetaStore {
                    key_binary: flag(b'b').is_some(),
                    set_stale: flag(b'I').is_some(),
                };
                let reply = self.store(op, key, item_flags, ttl, data, cas_in, how, now, d)?;
                let code: &[u8] = match reply {
                    b"STORED\r\n" => b"HD",
                    b"EXISTS\r\n" => b"EX",
                    b"NOT_FOUND\r\n" => b"NF",
                    b"NOT_STORED\r\n" => b"NS",
                    other => {
                        out.extend_from_slice(other);
                        return Ok(());
                    }
                };
                if code == b"HD" && quiet {
                    return Ok(());
                }
                let (slot, given) = match code {
                    b"HD" => self.stored_item(key, now, d)?,
                    _ => (None, None),
                };
                let rest = returned(self, slot, Some(given.unwrap_or(0)), None, d)?;
                out.extend_from_slice(code);
                out.extend_from_slice(&rest);
                out.extend_from_slice(b"\r\n");
            }
            b'd' => {
                let code: &[u8] = match slot {
                    None => b"NF",
                    Some(_) if cas_mismatch => b"EX",
                    Some(s) => {
                        if flag(b'I').is_some() {
                            // I: invalidate rather than delete. The item stays, stale, with
                            // a new CAS (and T's time to live), and its next reader gets
                            // the recache token.
                            let cas = self.next_cas(d)?;
                            let mut it = self.item_mut(s, d)?;
                            (it.stale, it.token_sent, it.cas) = (true, false, cas);
                            if let Some(ttl) = number(b'T') {
                                it.exptime_ms = meta_exptime(ttl, now);
                            }
                        } else {
                            self.unlink(s, d)?;
                        }
                        if quiet {
                            return Ok(());
                        }
                        b"HD"
                    }
                };
                out.extend_from_slice(code);
                out.extend_from_slice(&returned(self, None, None, None, d)?);
                out.extend_from_slice(b"\r\n");
            }
            b'a' => {
                let incr = !matches!(flag(b'M').and_then(|m| m.first()), Some(b'D' | b'd' | b'-'));
                let vivified = slot.is_none();
                // `given`: the CAS of a counter created with a time to live already past
                // (see `stored_item`).
                let (slot, value, given) = match slot {
                    // memcached refuses an empty value as non-numeric before it compares
                    // the CAS (`do_add_delta`).
                    Some(s) if cas_mismatch && self.item(s, d)?.value.is_empty() => {
                        out.extend_from_slice(NON_NUMERIC);
                        return Ok(());
                    }
                    Some(_) if cas_mismatch => {
                        out.extend_from_slice(b"EX");
                        out.extend_from_slice(&returned(self, None, None, None, d)?);
                        out.extend_from_slice(b"\r\n");
                        return Ok(());
                    }
                    Some(s) => match self.arith(s, incr, unsigned(b'D').unwrap_or(1), held, d)? {
                        Some(v) => (Some(s), v, None),
                        None => {
                            out.extend_from_slice(NON_NUMERIC);
                            return Ok(());
                        }
                    },
                    None => match number(b'N') {
                        // Autovivify: create the counter with J (default 0).
                        Some(ttl) => {
                            let initial = unsigned(b'J').unwrap_or(0).to_string().into_bytes();
                            let how = MetaStore::default();
                            let stored =
                                self.store(StoreOp::Add, key, 0, ttl as i32 as i64, &initial, 0, how, now, d)?;
                            if stored != b"STORED\r\n" {
                                out.extend_from_slice(b"NS");
                                out.extend_from_slice(&returned(self, None, None, None, d)?);
                                out.extend_from_slice(b"\r\n");
                                return Ok(());
                            }
                            let (slot, given) = self.stored_item(key, now, d)?;
                            (slot, initial, given)
                        }
                        None => {
                            out.extend_from_slice(b"NF");
                            out.extend_from_slice(&returned(self, None, None, None, d)?);
                            out.extend_from_slice(b"\r\n");
                            return Ok(());
                        }
                    },
                };
                let rest = returned(self, slot, given, None, d)?;
                // memcached's q hides a success, except the creation of a counter.
                if quiet && !vivified {
                    return Ok(());
                }
                if flag(b'v').is_some() {
                    out.extend_from_slice(format!("VA {}", value.len()).as_bytes());
                    out.extend_from_slice(&rest);
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(&value);
                    out.extend_from_slice(b"\r\n");
                } else {
                    out.extend_from_slice(b"HD");
                    out.extend_from_slice(&rest);
                    out.extend_from_slice(b"\r\n");
                }
            }
            _ => match slot {
                None => out.extend_from_slice(b"EN\r\n"),
                Some(s) => {
                    let links = self.links_of(s, d)?;
                    let it = self.item(s, d)?;
                    let size = crate::protocol::item_size(it.key.len(), it.flags, it.value.len());
                    let line = format!(
                        "ME {} exp={} la={} cas={} fetch={} cls={} size={size}\r\n",
                        String::from_utf8_lossy(&display_key(&it.key, it.key_binary)),
                        ttl_left(it.exptime_ms, now),
                        now.saturating_sub(links.accessed_ms) / 1000,
                        it.cas,
                        if links.fetched { "yes" } else { "no" },
                        slab_class(size),
                    );
                    out.extend_from_slice(line.as_bytes());
                }
            },
        }
        Ok(())
    }

    fn next_cas(&mut self, d: &mut Delta) -> R<u64> {
        let mut g = self.globals.write(d)?;
        g.cas += 1;
        Ok(g.cas)
    }

    fn bucket_of(&self, key: &[u8]) -> (u32, u32) {
        let h = lockstep_core::crc32c(key);
        (h, h & (self.limits.buckets - 1))
    }

    fn item(&self, slot: u32, d: &mut Delta) -> R<&Item> {
        match self.items.get(slot as usize).and_then(|s| s.as_ref()) {
            Some(g) => g.read(d),
            None => Err(self.dangling(item_id(slot), d)),
        }
    }

    fn item_mut<'a>(&'a mut self, slot: u32, d: &'a mut Delta) -> R<lockstep_guard::GuardMut<'a, Item>> {
        match self.items.get_mut(slot as usize).and_then(|s| s.as_mut()) {
            Some(g) => g.write(d),
            None => {
                d.record_corrupt(item_id(slot));
                Err(Corrupt(item_id(slot)))
            }
        }
    }

    fn links_mut<'a>(&'a mut self, slot: u32, d: &'a mut Delta) -> R<lockstep_guard::GuardMut<'a, Links>> {
        match self.links.get_mut(slot as usize).and_then(|s| s.as_mut()) {
            Some(g) => g.write(d),
            None => {
                d.record_corrupt(links_id(slot));
                Err(Corrupt(links_id(slot)))
            }
        }
    }

    /// A reference to a slot that holds nothing: the structure pointing at it is corrupt.
    fn dangling(&self, id: ObjectId, d: &mut Delta) -> Corrupt {
        d.record_corrupt(id);
        Corrupt(id)
    }

    /// Where a store that answered STORED left its item: its slot, or, when its time to
    /// live had already passed (the item is gone at once), the CAS it was given, which
    /// memcached's meta replies still show.
    fn stored_item(&mut self, key: &[u8], now: u64, d: &mut Delta) -> R<(Option<u32>, Option<u64>)> {
        Ok(match self.lookup(key, now, d)? {
            Some(slot) => (Some(slot), None),
            None => (None, Some(self.globals.read(d)?.cas)),
        })
    }

    /// The slot of a live item with this key; expired and flushed items are unlinked here
    /// (lazily, on access, at a deterministic point of the log).
    fn lookup(&mut self, key: &[u8], now: u64, d: &mut Delta) -> R<Option<u32>> {
        let (hash, b) = self.bucket_of(key);
        let mut found = None;
        // (no copy of the bucket's entries: a lookup is on every request's path)
        let entries = &self.buckets[b as usize].read(d)?.entries;
        for &(_, slot) in entries.iter().filter(|e| e.0 == hash) {
            if self.item(slot, d)?.key == key {
                found = Some(slot);
                break;
            }
        }
        let Some(slot) = found else { return Ok(None) };
        let it = self.item(slot, d)?;
        let g = self.globals.read(d)?;
        let expired = it.exptime_ms != 0 && it.exptime_ms <= now;
        let flushed = it.cas < g.oldest_cas
            || (g.oldest_live_ms != 0 && g.oldest_live_ms <= now && it.stored_ms <= g.oldest_live_ms);
        if expired || flushed {
            self.unlink(slot, d)?;
            return Ok(None);
        }
        Ok(Some(slot))
    }

    fn link(&mut self, item: Item, now: u64, d: &mut Delta) -> R<()> {
        let (hash, b) = self.bucket_of(&item.key);
        let size = item.size();
        let slot = self.alloc_slot(d)?;
        let i = slot as usize;
        if self.items.len() <= i {
            self.items.resize_with(i + 1, || None);
            self.links.resize_with(i + 1, || None);
        }
        if self.items[i].is_some() {
            // The allocator handed out a live slot: the slab is corrupt.
            d.record_corrupt(SLAB_ID);
            return Err(Corrupt(SLAB_ID));
        }
        self.items[i] = Some(Guarded::new(item_id(slot), item, d));
        self.buckets[b as usize].write(d)?.entries.push((hash, slot));
        let old_head = self.globals.read(d)?.lru_head;
        self.links[i] = Some(Guarded::new(
            links_id(slot),
            Links {
                prev: NIL,
                next: old_head,
                accessed_ms: now,
                fetched: false,
                key_hash: hash,
                size,
            },
            d,
        ));
        if old_head != NIL {
            self.links_mut(old_head, d)?.prev = slot;
        }
        {
            let mut g = self.globals.write(d)?;
            g.lru_head = slot;
            if g.lru_tail == NIL {
                g.lru_tail = slot;
            }
            g.items += 1;
            g.bytes += size;
        }
        self.evict(slot, d)
    }

    /// Evict from the LRU tail until the items fit; never the item just stored.
    fn evict(&mut self, keep: u32, d: &mut Delta) -> R<()> {
        loop {
            let g = self.globals.read(d)?;
            if g.bytes <= memory_limit(&self.limits, g) || g.lru_tail == NIL || g.lru_tail == keep {
                return Ok(());
            }
            let victim = g.lru_tail;
            self.unlink(victim, d)?;
            self.globals.write(d)?.evictions += 1;
        }
    }

    /// Takes the item out of the index, the LRU list and the accounting. The item itself
    /// is not read (its links say where it is and what it counts for): an evicted item is
    /// cold, and a check would read all of its value for nothing.
    fn unlink(&mut self, slot: u32, d: &mut Delta) -> R<()> {
        if self.items.get(slot as usize).is_none_or(|s| s.is_none()) {
            return Err(self.dangling(item_id(slot), d));
        }
        let Links {
            prev,
            next,
            key_hash,
            size,
            ..
        } = self.links_of(slot, d)?;
        let b = key_hash & (self.limits.buckets - 1);
        {
            let mut bucket = self.buckets[b as usize].write(d)?;
            let before = bucket.entries.len();
            bucket.entries.retain(|e| e.1 != slot);
            if bucket.entries.len() == before {
                drop(bucket);
                d.record_corrupt(bucket_id(b));
                return Err(Corrupt(bucket_id(b)));
            }
        }
        if prev != NIL {
            self.links_mut(prev, d)?.next = next;
        }
        if next != NIL {
            self.links_mut(next, d)?.prev = prev;
        }
        {
            let mut g = self.globals.write(d)?;
            if g.lru_head == slot {
                g.lru_head = next;
            }
            if g.lru_tail == slot {
                g.lru_tail = prev;
            }
            g.items -= 1;
            g.bytes = g.bytes.saturating_sub(size);
        }
        if let Some(gone) = self.items[slot as usize].take() {
            let gone = gone.into_value();
            self.spare.keep(gone.key);
            self.spare.keep(gone.value);
        }
        self.links[slot as usize] = None;
        d.record(item_id(slot), GONE);
        d.record(links_id(slot), GONE);
        self.free_slot(slot, d)
    }

    /// A slot for a new item: the last one freed, or a new one.
    fn alloc_slot(&mut self, d: &mut Delta) -> R<u32> {
        let pos = {
            let mut slab = self.slab.write(d)?;
            if slab.free_len == 0 {
                slab.high += 1;
                return Ok(slab.high - 1);
            }
            slab.free_len -= 1;
            slab.free_len
        };
        let chunk = pos / FREE_CHUNK;
        let Some(g) = self.free_chunks.get_mut(chunk as usize).and_then(|c| c.as_mut()) else {
            return Err(free_stack_corrupt(chunk, d));
        };
        let slot = {
            let mut c = g.write(d)?;
            match c.slots.pop() {
                Some(slot) if c.slots.len() as u32 == pos % FREE_CHUNK => slot,
                _ => {
                    drop(c);
                    return Err(free_stack_corrupt(chunk, d));
                }
            }
        };
        // The chunk just emptied stays for the next free, which would otherwise allocate
        // it again (a full store frees and allocates a slot per set, at this boundary);
        // the empty chunk above it, if one stayed, goes: at most one empty chunk lingers.
        if pos % FREE_CHUNK == 0 {
            let above = chunk + 1;
            if let Some(lingering @ Some(_)) = self.free_chunks.get_mut(above as usize) {
                *lingering = None;
                d.record(free_chunk_id(above), GONE);
            }
        }
        Ok(slot)
    }

    fn free_slot(&mut self, slot: u32, d: &mut Delta) -> R<()> {
        let pos = {
            let mut slab = self.slab.write(d)?;
            slab.free_len += 1;
            slab.free_len - 1
        };
        let chunk = pos / FREE_CHUNK;
        let i = chunk as usize;
        if self.free_chunks.len() <= i {
            self.free_chunks.resize_with(i + 1, || None);
        }
        match &mut self.free_chunks[i] {
            Some(g) => {
                let mut c = g.write(d)?;
                if c.slots.len() as u32 != pos % FREE_CHUNK {
                    drop(c);
                    return Err(free_stack_corrupt(chunk, d));
                }
                c.slots.push(slot);
            }
            None if pos % FREE_CHUNK == 0 => {
                let mut slots = Vec::with_capacity(FREE_CHUNK as usize);
                slots.push(slot);
                let c = FreeChunk { slots };
                self.free_chunks[i] = Some(Guarded::new(free_chunk_id(chunk), c, d));
            }
            None => return Err(free_stack_corrupt(chunk, d)),
        }
        Ok(())
    }

    /// Move an item to the LRU head if it was not refreshed recently.
    fn links_of(&self, slot: u32, d: &mut Delta) -> R<Links> {
        match self.links.get(slot as usize).and_then(|l| l.as_ref()) {
            Some(l) => Ok(l.read(d)?.clone()),
            None => Err(self.dangling(links_id(slot), d)),
        }
    }

    /// Move the item to the LRU head (at most once per `LRU_BUMP_INTERVAL_MS`) and record
    /// whether it has been read since stored (memcached's ITEM_FETCHED).
    fn bump(&mut self, slot: u32, now: u64, fetched: Fetched, d: &mut Delta) -> R<()> {
        let Links {
            prev,
            next,
            accessed_ms: accessed,
            fetched: was,
            ..
        } = self.links_of(slot, d)?;
        let now_fetched = match fetched {
            Fetched::Yes => true,
            Fetched::No => false,
            Fetched::Unchanged => was,
        };
        if now_fetched != was {
            self.links_mut(slot, d)?.fetched = now_fetched;
        }
        if now.saturating_sub(accessed) < LRU_BUMP_INTERVAL_MS {
            return Ok(());
        }
        if prev != NIL {
            // Not already the head: unlink and push at the head.
            self.links_mut(prev, d)?.next = next;
            if next != NIL {
                self.links_mut(next, d)?.prev = prev;
            }
            let old_head = {
                let mut g = self.globals.write(d)?;
                let h = g.lru_head;
                if g.lru_tail == slot {
                    g.lru_tail = prev;
                }
                g.lru_head = slot;
                h
            };
            self.links_mut(old_head, d)?.prev = slot;
            let mut l = self.links_mut(slot, d)?;
            l.prev = NIL;
            l.next = old_head;
        }
        self.links_mut(slot, d)?.accessed_ms = now;
        Ok(())
    }

    /// Update the byte count after an item changed size in place, and evict if needed.
    fn account(&mut self, old_size: u64, slot: u32, d: &mut Delta) -> R<()> {
        let new_size = self.item(slot, d)?.size();
        if new_size != old_size {
            self.links_mut(slot, d)?.size = new_size;
            let mut g = self.globals.write(d)?;
            g.bytes = g.bytes.saturating_sub(old_size) + new_size;
        }
        self.evict(slot, d)
    }

    // ---- statistics, digests, repair, snapshots -------------------------------------

    /// Globals without a check, for `stats` (statistics are not protected state).
    pub fn stats(&self) -> &Globals {
        self.globals.peek()
    }

    /// `lru_crawler metadump`: one line per live item in memcached's format (`classes`:
    /// only items of those slab classes). A debugging view of this replica, not ordered
    /// through the log, as memcached's crawler is not ordered with requests either.
    pub fn metadump(&self, classes: Option<&[u32]>) -> String {
        let g = self.globals.peek();
        let now = g.now_ms;
        let mut out = String::new();
        for (slot, it) in self.items.iter().enumerate() {
            let Some(it) = it.as_ref().map(|i| i.peek()) else {
                continue;
            };
            let expired = it.exptime_ms != 0 && it.exptime_ms <= now;
            let flushed = it.cas < g.oldest_cas
                || (g.oldest_live_ms != 0 && g.oldest_live_ms <= now && it.stored_ms <= g.oldest_live_ms);
            let size = crate::protocol::item_size(it.key.len(), it.flags, it.value.len());
            let cls = slab_class(size);
            if expired || flushed || classes.is_some_and(|c| !c.contains(&cls)) {
                continue;
            }
            let links = self.links.get(slot).and_then(|l| l.as_ref()).map(|l| l.peek());
            let la = links.map_or(0, |l| l.accessed_ms);
            let fetched = links.is_some_and(|l| l.fetched);
            let exp = if it.exptime_ms == 0 {
                -1
            } else {
                (it.exptime_ms / 1000) as i64
            };
            out.push_str(&format!(
                "key={} exp={exp} la={} cas={} fetch={} cls={cls} size={size}\n",
                uri_encode(&it.key),
                la / 1000,
                it.cas,
                if fetched { "yes" } else { "no" }
            ));
        }
        out
    }

    /// A digest of the whole protected state: every object's id and CRC, in id order.
    /// Replicas that agree have equal digests. Objects failing their check are counted.
    pub fn digest(&self) -> (u64, usize) {
        let mut h = lockstep_guard::Hasher::default();
        let mut bad = 0;
        self.for_each_object(|g| {
            h.u64(g.gid().0);
            h.u32(g.gcrc());
            bad += usize::from(!g.gok());
        });
        ((h.finish() as u64) << 32 | self.stats().items, bad)
    }

    /// The state audit's view of the store: for each of `groups` groups of object ids, a
    /// digest of every object's id and stored CRC. Replicas whose group digests are equal
    /// hold the same objects in that group; a replica that differs from the majority in a
    /// group repairs that group's objects (`ids_in_groups`). Stored CRCs are compared, not
    /// recomputed: a silent flip (CRC recomputed) shows as another CRC, and a flip at rest
    /// is caught by the object's own check at its next access (recomputing every object's
    /// CRC here took 100-180 ms for 400,000 items, against 2.4-6.7 ms).
    pub fn audit_groups(&self, groups: usize) -> Vec<u64> {
        let mut digests = vec![0u64; groups];
        self.for_each_object(|g| {
            let id = g.gid();
            // Order-independent within a group: a sum of well-mixed terms.
            let term = mix(id.0 ^ u64::from(g.gcrc()).rotate_left(23));
            let group = audit_group(id, groups);
            digests[group] = digests[group].wrapping_add(term);
        });
        digests
    }

    /// Item and link slots in use (the range of ids a group's repair must name).
    pub fn slot_count(&self) -> u64 {
        self.items.len() as u64
    }

    /// Every id that exists, or could exist with `slots` slots, and falls in one of
    /// `wanted` of `groups` groups: what a repair of those groups names (an id absent on
    /// the healthy replicas is removed here).
    pub fn ids_in_groups(&self, wanted: &BTreeSet<usize>, groups: usize, slots: u64) -> Vec<ObjectId> {
        let slots = slots.min(self.limits.memory_bytes / 48 + 1) as u32;
        let mut all = vec![SLAB_ID, GLOBALS_ID];
        all.extend((0..self.limits.buckets).map(bucket_id));
        all.extend((0..slots).flat_map(|s| [item_id(s), links_id(s)]));
        all.extend((0..=slots / FREE_CHUNK).map(free_chunk_id));
        all.retain(|&id| wanted.contains(&audit_group(id, groups)));
        all
    }

    fn for_each_object(&self, mut one: impl FnMut(&dyn GuardInfo)) {
        one(&self.slab);
        one(&self.globals);
        for b in &self.buckets {
            one(b);
        }
        for g in self.items.iter().flatten() {
            one(g);
        }
        for g in self.links.iter().flatten() {
            one(g);
        }
        for g in self.free_chunks.iter().flatten() {
            one(g);
        }
    }

    /// The current stored CRC of an object, or GONE if it does not exist.
    pub fn object_crc(&self, id: ObjectId) -> u32 {
        self.with_object(id, |g| g.gcrc()).unwrap_or(GONE)
    }

    fn with_object<T>(&self, id: ObjectId, f: impl FnOnce(&dyn GuardInfo) -> T) -> Option<T> {
        let i = id.index() as usize;
        match id.kind() {
            KIND_ITEM => self.items.get(i)?.as_ref().map(|g| f(g)),
            KIND_LINKS => self.links.get(i)?.as_ref().map(|g| f(g)),
            KIND_BUCKET => self.buckets.get(i).map(|g| f(g)),
            KIND_SLAB => Some(f(&self.slab)),
            KIND_GLOBALS => Some(f(&self.globals)),
            KIND_FREE => self.free_chunks.get(i)?.as_ref().map(|g| f(g)),
            _ => None,
        }
    }

    /// Pack an object for a repair: `None` if it does not exist here (the receiver then
    /// deletes its copy), or its bytes. The caller verifies health first.
    pub fn pack_object(&self, id: ObjectId, out: &mut Packer) -> bool {
        self.with_object(id, |g| g.gpack(out)).is_some()
    }

    pub fn object_exists(&self, id: ObjectId) -> bool {
        self.with_object(id, |_| ()).is_some()
    }

    /// Whether an object passes its check (absent objects do).
    pub fn object_ok(&self, id: ObjectId) -> bool {
        self.with_object(id, |g| g.gok()).unwrap_or(true)
    }

    /// Replace an object with a healthy replica's copy (`None`: it must not exist).
    pub fn replace_object(&mut self, id: ObjectId, packed: Option<&[u8]>) -> Result<(), UnpackError> {
        self.put_object(id, packed, None)
    }

    /// Put an object; with `crc`, keep that CRC instead of computing a fresh one.
    fn put_object(&mut self, id: ObjectId, packed: Option<&[u8]>, crc: Option<u32>) -> Result<(), UnpackError> {
        fn make<T: Protected>(id: ObjectId, b: &[u8], crc: Option<u32>) -> Result<Guarded<T>, UnpackError> {
            let v = unpack_all(b)?;
            Ok(match crc {
                Some(c) => Guarded::restore_with_crc(id, v, c),
                None => Guarded::restore(id, v),
            })
        }
        fn put<T: Protected>(
            slot: &mut Option<Guarded<T>>,
            id: ObjectId,
            p: Option<&[u8]>,
            crc: Option<u32>,
        ) -> Result<(), UnpackError> {
            *slot = match p {
                Some(b) => Some(make(id, b, crc)?),
                None => None,
            };
            Ok(())
        }
        let i = id.index() as usize;
        match id.kind() {
            KIND_ITEM | KIND_LINKS => {
                // No store can hold more items than its memory limit allows at the smallest
                // item size: a slot beyond that is bogus, and must not make us allocate.
                if i as u64 > self.limits.memory_bytes / 48 {
                    return Err(UnpackError("slot out of range"));
                }
                if self.items.len() <= i {
                    self.items.resize_with(i + 1, || None);
                    self.links.resize_with(i + 1, || None);
                }
                if id.kind() == KIND_ITEM {
                    put(&mut self.items[i], id, packed, crc)
                } else {
                    put(&mut self.links[i], id, packed, crc)
                }
            }
            KIND_BUCKET if i < self.buckets.len() => {
                self.buckets[i] = make(id, packed.ok_or(UnpackError("a bucket cannot be absent"))?, crc)?;
                Ok(())
            }
            KIND_SLAB => {
                self.slab = make(id, packed.ok_or(UnpackError("slab absent"))?, crc)?;
                Ok(())
            }
            KIND_GLOBALS => {
                self.globals = make(id, packed.ok_or(UnpackError("globals absent"))?, crc)?;
                Ok(())
            }
            KIND_FREE => {
                // As for slots: no more chunks than the most slots the memory limit allows.
                if i as u64 > self.limits.memory_bytes / 48 / FREE_CHUNK as u64 + 1 {
                    return Err(UnpackError("free chunk out of range"));
                }
                if self.free_chunks.len() <= i {
                    self.free_chunks.resize_with(i + 1, || None);
                }
                put(&mut self.free_chunks[i], id, packed, crc)
            }
            _ => Err(UnpackError("unknown object id")),
        }
    }

    /// The whole state, for a Raft snapshot: every existing object, packed.
    pub fn snapshot(&self) -> Vec<u8> {
        let mut p = Packer::default();
        self.snapshot_into(&mut p);
        p.buf
    }

    /// `snapshot`, appended to `p`.
    pub fn snapshot_into(&self, p: &mut Packer) {
        p.u32(self.limits.buckets);
        // The count goes first; it is known once every object is packed (packed in one
        // pass: a list of the ids first took 16 bytes per object, 6 MiB at 64 MiB).
        let count_at = p.buf.len();
        p.u64(0);
        let mut count = 0u64;
        self.for_each_object(|g| {
            p.u64(g.gid().0);
            // The stored CRC travels with the object, so that an object that is already
            // corrupt here is still caught on the replica that installs the snapshot.
            p.u32(g.gcrc());
            p.nested(|p| g.gpack(p));
            count += 1;
        });
        p.buf[count_at..count_at + 8].copy_from_slice(&count.to_le_bytes());
    }

    /// Rebuild from `snapshot`'s bytes (the limits other than the bucket count are ours).
    pub fn restore(limits: Limits, data: &[u8]) -> Result<Self, UnpackError> {
        let mut u = Unpacker::new(data);
        let buckets = u.u32()?;
        if buckets != limits.buckets {
            return Err(UnpackError("snapshot has a different bucket count"));
        }
        let mut store = Store::new(limits);
        let n = u.u64()?;
        for _ in 0..n {
            let id = ObjectId(u.u64()?);
            let crc = u.u32()?;
            let obj = u.bytes()?;
            store.put_object(id, Some(obj), Some(crc))?;
        }
        if !u.is_empty() {
            return Err(UnpackError("trailing bytes after snapshot"));
        }
        Ok(store)
    }

    /// Test-only corruption: flip bit `bit` (modulo the object's size) of the object that
    /// `target` names for `key`. With `recompute`, the CRC is updated too (a fault during
    /// an access, that only the cross-check can see). Returns the object hit.
    pub fn corrupt(&mut self, key: &[u8], target: Target, bit: u64, recompute: bool) -> Option<ObjectId> {
        let (hash, b) = self.bucket_of(key);
        let slot = self.buckets[b as usize]
            .peek()
            .entries
            .iter()
            .filter(|e| e.0 == hash)
            .map(|e| e.1)
            .find(|&s| {
                self.items
                    .get(s as usize)
                    .and_then(|i| i.as_ref())
                    .is_some_and(|i| i.peek().key == key)
            })?;
        match target {
            Target::Item => {
                let g = self.items[slot as usize].as_mut()?;
                g.corrupt_with(recompute, |it| {
                    if it.value.is_empty() {
                        it.flags ^= 1 << (bit % 32);
                    } else {
                        let n = it.value.len() as u64 * 8;
                        it.value[((bit % n) / 8) as usize] ^= 1 << (bit % 8);
                    }
                });
                Some(g.id())
            }
            Target::Bucket => {
                let g = &mut self.buckets[b as usize];
                g.corrupt_with(recompute, |bk| {
                    let e = bk.entries.iter_mut().find(|e| e.1 == slot).expect("entry");
                    e.1 ^= 1 << (bit % 8);
                });
                Some(g.id())
            }
            Target::Links => {
                let g = self.links[slot as usize].as_mut()?;
                g.corrupt_with(recompute, |l| l.accessed_ms ^= 1 << (bit % 40));
                Some(g.id())
            }
        }
    }
}

fn unpack_all<T: Protected>(b: &[u8]) -> Result<T, UnpackError> {
    let mut u = Unpacker::new(b);
    let v = T::unpack(&mut u)?;
    if !u.is_empty() {
        return Err(UnpackError("trailing bytes after object"));
    }
    Ok(v)
}

/// Object-safe view of a `Guarded<T>` for walks over heterogeneous objects.
trait GuardInfo {
    fn gid(&self) -> ObjectId;
    fn gcrc(&self) -> u32;
    fn gok(&self) -> bool;
    fn gpack(&self, out: &mut Packer);
}

impl<T: Protected> GuardInfo for Guarded<T> {
    fn gid(&self) -> ObjectId {
        self.id()
    }
    fn gcrc(&self) -> u32 {
        self.stored_crc()
    }
    fn gok(&self) -> bool {
        self.verify().is_ok()
    }
    fn gpack(&self, out: &mut Packer) {
        self.peek().pack(out)
    }
}

/// memcached's exptime rules, in log milliseconds: 0 never; negative: already expired;
/// up to 30 days: relative seconds; beyond: a Unix time in seconds.
/// The memory limit in force: what `cache_memlimit` set, else the configured one.
fn memory_limit(limits: &Limits, g: &Globals) -> u64 {
    if g.memlimit == 0 {
        limits.memory_bytes
    } else {
        g.memlimit.min(limits.memory_bytes)
    }
}

pub fn absolute_exptime(exptime: i64, now_ms: u64) -> u64 {
    if exptime == 0 {
        0
    } else if exptime < 0 {
        1
    } else if exptime <= RELATIVE_EXPTIME_MAX {
        now_ms + exptime as u64 * 1000
    } else {
        (exptime as u64 * 1000).max(1)
    }
}

/// The expiry a meta TTL token (`T`, `N`, `R`) names: memcached keeps it in 32 bits.
fn meta_exptime(token: i64, now_ms: u64) -> u64 {
    absolute_exptime(token as i32 as i64, now_ms)
}

const NON_NUMERIC: &[u8] = b"CLIENT_ERROR cannot increment or decrement non-numeric value\r\n";

/// Whether an arithmetic command's item is held by an unwritten reply (see
/// `command::HeldKeys`): memcached then makes a new item instead of rewriting in place.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Held {
    No,
    Yes,
}

/// Seconds an item has left, as meta commands report it: -1 if it never expires.
/// What an access does to an item's fetched mark (memcached's ITEM_FETCHED).
#[derive(Clone, Copy)]
enum Fetched {
    /// A read: get, gat, touch, mg without `u`.
    Yes,
    /// A new value: memcached stores a new item.
    No,
    Unchanged,
}

/// An item as it was before an mg read: `h` and `l` report the links from before the
/// read, and a `t` ahead of `T` the time to live from before the update.
/// What a meta store asks beyond a text-protocol one.
#[derive(Clone, Copy, Default)]
struct MetaStore {
    /// `b`: the key came base64-encoded.
    key_binary: bool,
    /// `I`: a CAS older than the item's stores a stale value instead of failing.
    set_stale: bool,
}

struct MgBefore {
    links: Links,
    exptime_ms: u64,
    /// Created by this mg's `N`.
    created: bool,
}

impl MgBefore {
    /// The item's expiry once `flags` (an mg's, in order) did their part: `T` sets it,
    /// and `N` on an item it created.
    fn exptime_after(&self, flags: &[Vec<u8>], now: u64) -> u64 {
        let ttl = |f: &[u8]| std::str::from_utf8(&f[1..]).ok()?.parse::<i64>().ok();
        flags.iter().fold(self.exptime_ms, |exptime, f| match (f[0], ttl(f)) {
            (b'T', Some(t)) => meta_exptime(t, now),
            (b'N', Some(t)) if self.created => meta_exptime(t, now),
            _ => exptime,
        })
    }
}

/// `k` followed by an item's key as memcached shows it: base64 and a `b` flag when it was
/// stored with a base64 key.
fn shown_key(key: &[u8], binary: bool) -> Vec<u8> {
    let b: &[u8] = if binary { b" b" } else { b"" };
    [&b"k"[..], &display_key(key, binary), b].concat()
}

/// An item's key as memcached prints it (base64 when stored with a base64 key).
fn display_key(key: &[u8], binary: bool) -> Vec<u8> {
    match binary {
        true => crate::protocol::base64_encode(key).into_bytes(),
        false => key.to_vec(),
    }
}

/// The free-slot stack disagrees with itself (the slab's count against chunk `chunk`):
/// either may be wrong, so both are reported, and the cross-check repairs whichever
/// differs from the majority.
fn free_stack_corrupt(chunk: u32, d: &mut Delta) -> Corrupt {
    d.record_corrupt(SLAB_ID);
    d.record_corrupt(free_chunk_id(chunk));
    Corrupt(free_chunk_id(chunk))
}

/// memcached's slab classes with its default settings (`-n 48 -f 1.25`, 1 MiB items):
/// chunk sizes from 96 bytes, each 1.25 times the last rounded up to 8, up to 512 KiB.
pub const SLAB_CLASSES: u32 = slab_classes();

const fn slab_classes() -> u32 {
    let (mut size, mut cls) = (96u32, 1u32);
    while (size as u64) * 5 < 512 * 1024 * 4 {
        size = size * 5 / 4;
        size = size.div_ceil(8) * 8;
        cls += 1;
    }
    cls
}

/// The slab class memcached would store an item of `ntotal` bytes in.
pub fn slab_class(ntotal: usize) -> u32 {
    let mut size = 96usize;
    let mut cls = 1;
    while cls < SLAB_CLASSES && size < ntotal {
        size = (size * 5 / 4).div_ceil(8) * 8;
        cls += 1;
    }
    cls
}

/// memcached's `uriencode`: letters, digits and `-._~` stay, anything else is `%XX`.
fn uri_encode(key: &[u8]) -> String {
    let mut s = String::with_capacity(key.len());
    for &b in key {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            s.push(b as char);
        } else {
            s.push_str(&format!("%{b:02X}"));
        }
    }
    s
}

fn ttl_left(exptime_ms: u64, now: u64) -> i64 {
    if exptime_ms == 0 {
        -1
    } else {
        (exptime_ms.saturating_sub(now)).div_ceil(1000) as i64
    }
}

/// A counter's value as memcached reads it (`strtoull`): leading white space, an optional
/// sign, digits, then the end or white space; a negative number or an overflow is not a
/// counter.
fn parse_counter(value: &[u8]) -> Option<u64> {
    let s = value.trim_ascii_start();
    let (negative, digits) = match s.first() {
        Some(b'-') => (true, &s[1..]),
        Some(b'+') => (false, &s[1..]),
        _ => (false, s),
    };
    let end = digits.iter().position(|b| !b.is_ascii_digit()).unwrap_or(digits.len());
    if end == 0 || !digits[end..].first().is_none_or(|b| b.is_ascii_whitespace()) {
        return None;
    }
    let n = std::str::from_utf8(&digits[..end]).ok()?.parse::<u64>().ok()?;
    (!negative || n == 0).then_some(n)
}

/// The audit group of an object id, out of `groups`.
pub fn audit_group(id: ObjectId, groups: usize) -> usize {
    (mix(id.0) % groups as u64) as usize
}

/// SplitMix64's finaliser: spreads every input bit over the output.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod flush_tests {
    use super::*;

    fn run(s: &mut Store, cmd: Command, now: u64) -> String {
        String::from_utf8(s.apply(&cmd, now, &mut Delta::default())).unwrap()
    }

    fn set(key: &str) -> Command {
        Command::Store {
            op: StoreOp::Set,
            key: key.into(),
            flags: 0,
            exptime: 0,
            data: b"v".to_vec(),
            cas: 0,
        }
    }

    fn get(key: &str) -> Command {
        Command::Get {
            keys: vec![key.into()],
            with_cas: false,
            touch: None,
        }
    }

    /// A mass delete leaves thousands of free slots; every protected object stays small
    /// (what an access checks does not grow with the free stack), slots are reused, and
    /// the free stack survives a snapshot and is repaired object by object.
    #[test]
    fn free_slots_live_in_small_objects_and_are_reused() {
        let mut s = Store::new(Limits::default());
        let keys: Vec<String> = (0..5000).map(|i| format!("k{i}")).collect();
        for k in &keys {
            assert_eq!(run(&mut s, set(k), 1000), "STORED\r\n");
        }
        for k in &keys {
            assert_eq!(
                run(
                    &mut s,
                    Command::Delete {
                        key: k.as_bytes().to_vec()
                    },
                    1000
                ),
                "DELETED\r\n"
            );
        }
        let mut largest = 0;
        s.for_each_object(|g| {
            let mut p = Packer::default();
            g.gpack(&mut p);
            largest = largest.max(p.buf.len());
        });
        assert!(largest <= 4 + 4 * FREE_CHUNK as usize, "an object of {largest} bytes");
        // Restored from a snapshot, the store hands out the same slots.
        let mut restored = Store::restore(Limits::default(), &s.snapshot()).unwrap();
        assert_eq!(restored.digest(), s.digest());
        for k in keys.iter().take(3000) {
            run(&mut s, set(k), 2000);
            run(&mut restored, set(k), 2000);
        }
        assert_eq!(restored.digest(), s.digest());
        assert_eq!(s.slot_count(), 5000, "freed slots were reused, none added");
        // A chunk of the free stack is an object like any other: replaced from a healthy
        // copy, the store goes on allocating.
        let id = free_chunk_id(0);
        let mut healthy = Packer::default();
        assert!(s.pack_object(id, &mut healthy));
        restored.replace_object(id, Some(&healthy.buf)).unwrap();
        assert_eq!(run(&mut restored, set("one-more"), 3000), "STORED\r\n");
    }

    /// A set that takes the last slot of a chunk leaves the chunk in place for the next
    /// free (a full store frees and takes a slot per set, at that boundary), and at most
    /// one empty chunk lingers: the free stack's objects stay bounded by what it holds.
    #[test]
    fn an_emptied_free_chunk_stays_and_only_one_lingers() {
        let mut s = Store::new(Limits::default());
        let chunks = |s: &Store| -> Vec<usize> {
            let present = s.free_chunks.iter().enumerate().filter(|(_, c)| c.is_some());
            present.map(|(i, _)| i).collect()
        };
        let delete = |key: &str| Command::Delete {
            key: key.as_bytes().to_vec(),
        };
        for i in 0..200 {
            run(&mut s, set(&format!("k{i}")), 1000);
        }
        // 130 frees fill chunks 0 and 1 and start chunk 2.
        for i in 0..130 {
            assert_eq!(run(&mut s, delete(&format!("k{i}")), 1000), "DELETED\r\n");
        }
        assert_eq!(chunks(&s), [0, 1, 2]);
        // Taking 2 slots empties chunk 2, which stays.
        run(&mut s, set("a"), 1000);
        run(&mut s, set("b"), 1000);
        assert_eq!(chunks(&s), [0, 1, 2]);
        // Emptying chunk 1 lets chunk 2 go; chunk 1 stays.
        for i in 0..64 {
            run(&mut s, set(&format!("c{i}")), 1000);
        }
        assert_eq!(chunks(&s), [0, 1]);
        // Free and take one slot, many times, at that boundary: nothing comes or goes.
        for i in 0..100 {
            run(&mut s, delete(&format!("k{}", 130 + i % 70)), 1000);
            assert_eq!(chunks(&s), [0, 1]);
            run(&mut s, set(&format!("k{}", 130 + i % 70)), 1000);
            assert_eq!(chunks(&s), [0, 1]);
        }
        // Down to an empty stack: only chunk 0 is left, empty, and a restored store has
        // the same objects.
        for i in 0..64 {
            run(&mut s, set(&format!("d{i}")), 1000);
        }
        assert_eq!(chunks(&s), [0]);
        assert_eq!(s.slot_count(), 200, "every new item took a freed slot");
        let restored = Store::restore(Limits::default(), &s.snapshot()).unwrap();
        assert_eq!(restored.digest(), s.digest());
        assert_eq!(chunks(&restored), [0]);
    }

    /// An item's links carry its key hash and size (an eviction reads only them): after
    /// stores, replaces, appends, prepends, counters that grow, deletes and evictions,
    /// every item's links agree with the item, and the sizes add up to the store's bytes.
    #[test]
    fn every_items_links_know_its_bucket_and_size() {
        let mut s = Store::new(Limits::new(256 << 10, 1 << 20));
        let store = |op: StoreOp, key: &str, data: &[u8]| Command::Store {
            op,
            key: key.into(),
            flags: 0,
            exptime: 0,
            data: data.to_vec(),
            cas: 0,
        };
        // 300 keys change in every way, then new keys evict some of them.
        for n in 0..4000usize {
            let key = match n {
                ..3000 => format!("k{}", n % 300),
                _ => format!("new{n}"),
            };
            let cmd = match if n < 3000 { n % 7 } else { 5 } {
                0 => store(StoreOp::Append, &key, b"-tail"),
                1 => store(StoreOp::Prepend, &key, b"head-"),
                2 => Command::Delete { key: key.into_bytes() },
                3 => Command::Arith {
                    key: key.into_bytes(),
                    incr: true,
                    delta: 1 << 40,
                },
                4 => store(StoreOp::Set, &key, b"9"),
                _ => store(StoreOp::Set, &key, &vec![b'v'; 100 + (n * 37) % 900]),
            };
            run(&mut s, cmd, 1000);
        }
        assert!(s.globals.peek().evictions > 0, "the test wants evictions");
        let mut bytes = 0;
        for (slot, item) in s.items.iter().enumerate() {
            let Some(item) = item else { continue };
            let item = item.peek();
            let links = s.links[slot].as_ref().expect("links of a live item").peek();
            assert_eq!(links.key_hash, lockstep_core::crc32c(&item.key));
            assert_eq!(links.size, item.size());
            bytes += item.size();
        }
        assert_eq!(bytes, s.globals.peek().bytes);
    }

    /// A full store takes each new item's buffers from the items it evicted (no malloc
    /// per set once it is full), and no item keeps a buffer far beyond its value's size
    /// (the memory limit counts sizes, not capacities).
    #[test]
    fn evicted_items_lend_their_buffers_and_no_item_keeps_a_far_larger_one() {
        let limits = Limits::new(1 << 20, 1 << 20);
        let mut s = Store::new(limits);
        let value = |n: usize| Command::Store {
            op: StoreOp::Set,
            key: format!("key-{n:06}").into_bytes(),
            flags: 0,
            exptime: 0,
            data: vec![b'v'; 400],
            cas: 0,
        };
        let mut n = 0;
        while s.globals.peek().evictions == 0 {
            assert_eq!(run(&mut s, value(n), 1000), "STORED\r\n");
            n += 1;
        }
        let kept = s.spare.len();
        assert!(kept > 0, "an eviction kept no buffer");
        let (spare_key, spare_value) = (s.spare.next_for(10).unwrap(), s.spare.next_for(400).unwrap());
        let before = s.globals.peek().evictions;
        assert_eq!(run(&mut s, value(n), 1000), "STORED\r\n");
        assert_eq!(s.globals.peek().evictions, before + 1);
        let slot = s.globals.peek().lru_head as usize;
        let item = s.items[slot].as_ref().unwrap().peek();
        assert_eq!(item.key, format!("key-{n:06}").as_bytes());
        assert_eq!(
            item.value.as_ptr(),
            spare_value,
            "the new value is in an evicted item's buffer"
        );
        assert_eq!(
            item.key.as_ptr(),
            spare_key,
            "the new key is in an evicted item's buffer"
        );
        assert_eq!(s.spare.len(), kept, "buffers taken, as many given back");
        // The bound on spare buffers holds however many items go.
        let flushed_at = 2000;
        run(&mut s, Command::FlushAll { delay: 0 }, flushed_at);
        for k in 0..=n {
            run(&mut s, get(&format!("key-{k:06}")), flushed_at);
        }
        assert_eq!(s.globals.peek().items, 0);
        assert!(s.spare.len() <= 2 * crate::buffers::KEPT);
        // A value replaced by a much smaller one does not keep its old buffer.
        let sized = |data: Vec<u8>| Command::Store {
            op: StoreOp::Set,
            key: b"resized".to_vec(),
            flags: 0,
            exptime: 0,
            data,
            cas: 0,
        };
        run(&mut s, sized(vec![b'x'; 64 << 10]), 3000);
        run(&mut s, sized(b"tiny".to_vec()), 3000);
        let slot = s.lookup(b"resized", 3000, &mut Delta::default()).unwrap().unwrap();
        let item = s.items[slot as usize].as_ref().unwrap().peek();
        assert_eq!(item.value, b"tiny");
        assert!(item.value.capacity() <= 2 * 4 + 64, "{}", item.value.capacity());
    }

    /// As memcached: flush_all removes what was stored before it, even in the same
    /// millisecond (the same log entry), and nothing stored after it.
    #[test]
    fn flush_all_in_the_same_millisecond_as_the_sets_around_it() {
        let mut s = Store::new(Limits::default());
        run(&mut s, set("before"), 1000);
        assert_eq!(run(&mut s, Command::FlushAll { delay: 0 }, 1000), "OK\r\n");
        run(&mut s, set("after"), 1000);
        assert_eq!(run(&mut s, get("before"), 1000), "END\r\n");
        assert_eq!(run(&mut s, get("after"), 1000), "VALUE after 0 1\r\nv\r\nEND\r\n");
        assert_eq!(run(&mut s, get("after"), 5000), "VALUE after 0 1\r\nv\r\nEND\r\n");
    }

    #[test]
    fn cache_memlimit_lowers_the_limit_for_later_stores_and_survives_a_snapshot() {
        let limits = Limits {
            memory_bytes: 16 << 20,
            ..Limits::default()
        };
        let mut s = Store::new(limits.clone());
        assert_eq!(
            run(&mut s, Command::MemLimit { mb: 32 }, 1),
            "MEMLIMIT_ADJUST_FAILED out of bounds or unable to adjust\r\n"
        );
        assert_eq!(s.memory_limit(), 16 << 20);
        assert_eq!(run(&mut s, Command::MemLimit { mb: 8 }, 1), "OK\r\n");
        assert_eq!(s.memory_limit(), 8 << 20);
        let big = |k: usize| Command::Store {
            op: StoreOp::Set,
            key: format!("k{k}").into_bytes(),
            flags: 0,
            exptime: 0,
            data: vec![b'v'; 1 << 20],
            cas: 0,
        };
        for k in 0..12 {
            assert_eq!(run(&mut s, big(k), 2), "STORED\r\n");
        }
        assert!(s.globals.peek().bytes <= 8 << 20, "{}", s.globals.peek().bytes);
        assert!(s.globals.peek().evictions >= 4);
        let restored = Store::restore(limits, &s.snapshot()).unwrap();
        assert_eq!(restored.memory_limit(), 8 << 20);
        assert_eq!(restored.digest(), s.digest());
    }

    #[test]
    fn meta_get_with_u_leaves_the_lru_alone() {
        let tail_key = |s: &Store| {
            s.items[s.globals.peek().lru_tail as usize]
                .as_ref()
                .unwrap()
                .peek()
                .key
                .clone()
        };
        let mg = |key: &str, flags: &[&str]| Command::Meta {
            kind: b'g',
            key: key.into(),
            flags: flags.iter().map(|f| f.as_bytes().to_vec()).collect(),
            data: Vec::new(),
        };
        let mut s = Store::new(Limits::default());
        run(&mut s, set("a"), 1000);
        run(&mut s, set("b"), 1001);
        assert_eq!(tail_key(&s), b"a");
        // Later than the bump interval, so that a plain read would move it.
        let later = 1001 + LRU_BUMP_INTERVAL_MS;
        assert_eq!(run(&mut s, mg("a", &["v", "u"]), later), "VA 1\r\nv\r\n");
        assert_eq!(tail_key(&s), b"a", "u must not bump");
        run(&mut s, mg("a", &["v"]), later + 1);
        assert_eq!(tail_key(&s), b"b", "a plain mg bumps");
    }
}
