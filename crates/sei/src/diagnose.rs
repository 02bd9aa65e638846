//! What `lockstep cc` reads in GCC's output, and what it adds to it.
//!
//! Three failures of `gcc -fgnu-tm` stop builds that compile without it:
//!
//! - **always_inline.** With -fgnu-tm, a function that GCC finds (or is told) to be
//!   `const` is also transaction-pure, and GCC 12 never inlines a transaction-pure
//!   function into one that is not (ipa-inline.cc, `CIF_UNSPECIFIED`). An
//!   `always_inline` helper such as xxhash's or murmur3's then fails with an error whose
//!   reason is empty: "inlining failed in call to 'always_inline' 'fmix32': ".
//! - **Internal compiler errors** in the TM passes, such as GCC 12's crash in
//!   `requires_barrier` (trans-mem.cc:1538) on a string literal read in a loop: ivopts
//!   turns `"get "[i]` into a TARGET_MEM_REF based on the literal, which the TM
//!   instrumentation does not expect.
//! - **"unsafe function call 'f' within atomic transaction"**, which names the callee of
//!   the transaction, not the call further down that cannot be instrumented.
//!
//! The first two are retried with a flag that avoids them (see [`Remedy`]); for the
//! third, [`trace_unsafe_calls`] walks GCC's call graph down to the libc call that is
//! the root cause and names the sei.h function that replaces it.

use std::collections::{HashMap, HashSet, VecDeque};
use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};

use crate::{Install, Lang, HEADER};

/// Removes the terminal colour sequences that `-fdiagnostics-color` adds.
pub fn strip_ansi(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\u{1b}' {
            out.push(c);
            continue;
        }
        match chars.peek() {
            // CSI: ESC [ parameters final-byte
            Some('[') => {
                chars.next();
                for c in chars.by_ref() {
                    if ('@'..='~').contains(&c) {
                        break;
                    }
                }
            }
            // OSC (hyperlinks): ESC ] ... terminated by BEL or ESC \
            Some(']') => {
                chars.next();
                while let Some(c) = chars.next() {
                    if c == '\u{7}' {
                        break;
                    }
                    if c == '\u{1b}' {
                        chars.next();
                        break;
                    }
                }
            }
            _ => {}
        }
    }
    out
}

/// The names quoted in one diagnostic line, in order. GCC quotes with ‘…’ in a UTF-8
/// locale and with '…' otherwise.
fn quoted(line: &str) -> Vec<&str> {
    let mut names = Vec::new();
    let mut rest = line;
    while let Some(start) = rest.find(['\u{2018}', '\'']) {
        let open = rest[start..].chars().next().map_or(1, char::len_utf8);
        let after = &rest[start + open..];
        let Some(end) = after.find(['\u{2019}', '\'']) else {
            break;
        };
        names.push(&after[..end]);
        let close = after[end..].chars().next().map_or(1, char::len_utf8);
        rest = &after[end + close..];
    }
    names
}

/// The plain C name of a function as GCC prints it: without `__builtin_` (so that
/// `__builtin___memcpy_chk` is `__memcpy_chk`), without clone suffixes (`.isra.0`) and,
/// for C++, without the signature and the scope.
pub fn plain_name(name: &str) -> String {
    let mut n = name.trim();
    if let Some(i) = n.find('(') {
        n = &n[..i];
    }
    if let Some(i) = n.rfind([' ', '*', '&']) {
        n = &n[i + 1..];
    }
    if let Some(i) = n.rfind("::") {
        n = &n[i + 2..];
    }
    if let Some(i) = n.find('.') {
        n = &n[..i];
    }
    let n = match n.strip_prefix("__builtin_") {
        Some(rest) if !rest.is_empty() => rest,
        _ => n,
    };
    n.to_string()
}

/// The callee of GCC's "inlining failed in call to 'always_inline' 'f': " error when
/// its reason is empty, which is the transaction-pure refusal described above. Other
/// reasons (a target option mismatch, a missing body) are real and are not retried.
pub fn tm_always_inline_failure(stderr: &str) -> Option<String> {
    strip_ansi(stderr).lines().find_map(|line| {
        if !line.contains("inlining failed in call to") || !line.contains("always_inline") {
            return None;
        }
        let head = line.trim_end().strip_suffix(':')?;
        let names = quoted(head);
        // The reason follows the last closing quote; an empty one leaves `head` ending
        // in the quote itself.
        if !(head.ends_with('\u{2019}') || head.ends_with('\'')) {
            return None;
        }
        names.last().map(|n| n.to_string())
    })
}

/// An internal compiler error reported by GCC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ice {
    /// What follows "internal compiler error: ", e.g. "in requires_barrier, at trans-mem.cc:1538".
    pub what: String,
    /// The crash is in a transactional-memory pass or in trans-mem.cc.
    pub in_tm: bool,
}

/// The first internal compiler error in GCC's output, if any.
pub fn internal_compiler_error(stderr: &str) -> Option<Ice> {
    let text = strip_ansi(stderr);
    let line = text.lines().find(|l| l.contains("internal compiler error"))?;
    let what = line
        .split_once("internal compiler error")
        .map(|(_, rest)| rest.trim_start_matches(':').trim().to_string())
        .unwrap_or_default();
    // "during GIMPLE pass: tmmark" / "during IPA pass: tmipa" name the pass; the TM
    // passes are tmlower, tmmark, tmedge, tmipa, tmmemopt and *diagnose_tm_blocks.
    let in_tm = text.contains("trans-mem")
        || text.lines().any(|l| {
            l.trim_start().starts_with("during ")
                && l.rsplit(':').next().is_some_and(|pass| {
                    let pass = pass.trim();
                    pass.starts_with("tm") || pass.contains("diagnose_tm")
                })
        });
    Some(Ice { what, in_tm })
}

/// A flag set with which a failed compilation is retried once.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remedy {
    /// `-fno-ipa-pure-const`: GCC no longer discovers `const` functions, so it no longer
    /// makes them transaction-pure, and `always_inline` helpers are inlined again, inside
    /// and outside transactions. Only explicit `const` / `transaction_pure` remain.
    NoPureConst,
    /// `always_inline` becomes `unused`: for helpers declared both `always_inline` and
    /// `const` (or `transaction_pure`), which GCC can only call, not inline.
    DropAlwaysInline,
    /// `-fno-ivopts`: the loop optimisation that bases an address on a string literal,
    /// which crashes GCC 12's TM instrumentation (trans-mem.cc:1538).
    NoIvopts,
}

impl Remedy {
    pub fn flags(self) -> &'static [&'static str] {
        match self {
            Remedy::NoPureConst => &["-fno-ipa-pure-const"],
            Remedy::DropAlwaysInline => &["-Dalways_inline=__unused__", "-D__always_inline__=__unused__"],
            Remedy::NoIvopts => &["-fno-ivopts"],
        }
    }
}

/// What to do about a failed compilation, given the remedies already applied. Returns
/// the remedy to retry with and the line that says why.
pub fn next_remedy(stderr: &str, applied: &[Remedy]) -> Option<(Remedy, String)> {
    if let Some(callee) = tm_always_inline_failure(stderr) {
        let why = format!(
            "GCC refused to inline always_inline '{callee}' with an empty reason: under -fgnu-tm it \
             treats functions it finds const as transaction-pure and does not inline those"
        );
        if !applied.contains(&Remedy::NoPureConst) {
            return Some((Remedy::NoPureConst, why));
        }
        if !applied.contains(&Remedy::DropAlwaysInline) {
            return Some((
                Remedy::DropAlwaysInline,
                format!("{why} ('{callee}' is declared const or transaction_pure, so it stays a call)"),
            ));
        }
    }
    if let Some(ice) = internal_compiler_error(stderr) {
        if ice.in_tm && !applied.contains(&Remedy::NoIvopts) {
            return Some((Remedy::NoIvopts, ice_explanation(&ice)));
        }
    }
    None
}

/// The explanation of an internal compiler error in a `-fgnu-tm` compilation.
pub fn ice_explanation(ice: &Ice) -> String {
    let what = if ice.what.is_empty() {
        String::new()
    } else {
        format!(" ({})", ice.what)
    };
    if ice.in_tm {
        format!(
            "GCC crashed in its transactional-memory instrumentation{what}: a GCC bug, not an error \
             in your code (GCC 12 crashes on a string literal read in a loop, see docs/sei.md, Pitfalls)"
        )
    } else {
        format!("GCC crashed{what}: a GCC bug, not an error in your code")
    }
}

/// The functions named by GCC's "unsafe function call 'f' within atomic transaction"
/// (or "within 'transaction_safe' function") errors, in order, without repeats.
pub fn unsafe_calls(stderr: &str) -> Vec<String> {
    let mut seen = HashSet::new();
    strip_ansi(stderr)
        .lines()
        .filter(|l| l.contains("unsafe function call") && l.contains("within"))
        .filter_map(|l| {
            let after = &l[l.find("unsafe function call")?..];
            quoted(after).first().map(|n| plain_name(n))
        })
        .filter(|n| !n.is_empty() && seen.insert(n.clone()))
        .collect()
}

/// GCC's "unsafe indirect function call within atomic transaction" error.
pub fn has_unsafe_indirect_call(stderr: &str) -> bool {
    strip_ansi(stderr).contains("unsafe indirect function call")
}

/// One function in GCC's initial call graph (`-fdump-ipa-cgraph`).
#[derive(Debug, Clone, Default)]
pub struct Node {
    /// The name in the source (the dump's parenthesised name, made plain).
    pub name: String,
    /// As written in the declaration, e.g. `__builtin___memcpy_chk`: what the probe names.
    pub decl: String,
    /// The function is defined in this translation unit.
    pub body: bool,
    /// Callees, as indices into [`CallGraph::nodes`].
    pub calls: Vec<usize>,
    /// The function calls through a pointer.
    pub indirect: bool,
}

/// The call graph of one translation unit, before any inlining.
#[derive(Debug, Clone, Default)]
pub struct CallGraph {
    pub nodes: Vec<Node>,
    by_name: HashMap<String, usize>,
}

impl CallGraph {
    /// Parses the first "Initial Symbol table:" of a `-fdump-ipa-cgraph` dump. Nodes are
    /// headed `asmname/order (declname) @0x…` and followed by indented attributes.
    pub fn parse(dump: &str) -> CallGraph {
        let mut graph = CallGraph::default();
        let mut calls_by_order: Vec<(usize, Vec<String>)> = Vec::new();
        let mut index_of_order: HashMap<String, usize> = HashMap::new();
        let mut in_table = false;
        let mut current: Option<usize> = None;
        for line in dump.lines() {
            if !line.starts_with(' ') && !line.is_empty() {
                if line.starts_with("Initial Symbol table") {
                    if in_table || !graph.nodes.is_empty() {
                        break;
                    }
                    in_table = true;
                    continue;
                }
                if !in_table {
                    continue;
                }
                // A node header; anything else at column 0 ends the table.
                let Some((head, _addr)) = line.rsplit_once(" @0x") else {
                    if !graph.nodes.is_empty() {
                        break;
                    }
                    continue;
                };
                let Some((asm_order, decl)) = head.split_once(" (") else {
                    continue;
                };
                let decl = decl.strip_suffix(')').unwrap_or(decl);
                let Some((_, order)) = asm_order.rsplit_once('/') else {
                    continue;
                };
                let index = graph.nodes.len();
                graph.nodes.push(Node {
                    name: plain_name(decl),
                    decl: decl.to_string(),
                    ..Node::default()
                });
                index_of_order.insert(order.to_string(), index);
                current = Some(index);
                continue;
            }
            let (Some(i), true) = (current, in_table) else { continue };
            let attr = line.trim_start();
            if let Some(flags) = attr.strip_prefix("Function flags:") {
                graph.nodes[i].body = flags.split_whitespace().any(|f| f == "body");
            } else if let Some(callees) = attr.strip_prefix("Calls:") {
                let orders = callees
                    .split_whitespace()
                    .filter_map(|c| c.rsplit_once('/').map(|(_, o)| o.to_string()))
                    .collect();
                calls_by_order.push((i, orders));
            } else if attr.starts_with("Indirect call") || (attr.starts_with("Has ") && attr.contains("indirect")) {
                graph.nodes[i].indirect = true;
            } else if attr.starts_with("Type:") && attr.contains("variable") {
                current = None;
            }
        }
        for (i, orders) in calls_by_order {
            // GCC lists the most recent call first: reversed, chains come out in source order.
            let mut callees: Vec<usize> = orders
                .iter()
                .rev()
                .filter_map(|o| index_of_order.get(o).copied())
                .collect();
            let mut seen = HashSet::new();
            callees.retain(|c| seen.insert(*c));
            graph.nodes[i].calls = callees;
        }
        for (i, node) in graph.nodes.iter().enumerate() {
            graph.by_name.entry(node.name.clone()).or_insert(i);
        }
        graph
    }

    pub fn find(&self, name: &str) -> Option<usize> {
        self.by_name.get(&plain_name(name)).copied()
    }

    /// The functions reachable from `roots` (the roots included), for the probe.
    pub fn reachable(&self, roots: &[String]) -> Vec<usize> {
        let mut seen = HashSet::new();
        let mut queue: VecDeque<usize> = roots.iter().filter_map(|r| self.find(r)).collect();
        let mut out = Vec::new();
        while let Some(i) = queue.pop_front() {
            if !seen.insert(i) {
                continue;
            }
            out.push(i);
            if self.nodes[i].body {
                queue.extend(self.nodes[i].calls.iter().copied());
            }
        }
        out
    }
}

/// libc functions and the sei.h functions that replace them. Only those the embedded
/// header really declares are suggested (see [`replacement`]).
const REPLACEMENTS: &[(&str, &str)] = &[
    ("memcmp", "sei_memcmp"),
    ("bcmp", "sei_memcmp"),
    ("strlen", "sei_strlen"),
    ("strnlen", "sei_strnlen"),
    ("memchr", "sei_memchr"),
    ("strchr", "sei_strchr"),
    ("strtoul", "sei_strtoul"),
    ("strtoull", "sei_strtoull"),
    ("snprintf", "sei_snprintf"),
    ("sprintf", "sei_snprintf"),
    ("vsnprintf", "sei_vsnprintf"),
    ("vsprintf", "sei_vsnprintf"),
];

/// The libc name behind a `_FORTIFY_SOURCE` checking function (`__memcpy_chk` → `memcpy`).
pub fn fortified(name: &str) -> Option<&str> {
    name.strip_prefix("__")
        .and_then(|n| n.strip_suffix("_chk"))
        .filter(|n| !n.is_empty())
}

/// The sei.h replacement of a libc function, if the header declares it.
pub fn replacement(name: &str) -> Option<&'static str> {
    let name = fortified(name).unwrap_or(name);
    let (_, sei) = REPLACEMENTS.iter().find(|(libc, _)| *libc == name)?;
    declares(HEADER, sei).then_some(*sei)
}

/// True if `header` contains the identifier `ident` (not as a part of a longer one).
fn declares(header: &[u8], ident: &str) -> bool {
    let text = String::from_utf8_lossy(header);
    let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    text.match_indices(ident).any(|(at, _)| {
        let before = text[..at].chars().next_back();
        let after = text[at + ident.len()..].chars().next();
        !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
    })
}

/// The functions that sei.h wraps with `transaction_wrap(f)` (send, write, the mutex
/// functions…): GCC replaces calls to them inside transactions, so they are safe.
pub fn wrapped_by_header() -> Vec<String> {
    let text = String::from_utf8_lossy(HEADER);
    text.match_indices("transaction_wrap(")
        .filter_map(|(at, m)| {
            let rest = &text[at + m.len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            (!name.is_empty()).then_some(name)
        })
        .collect()
}

/// Functions GCC itself replaces inside transactions (its TM builtins): never a root cause.
const GCC_TM_BUILTINS: &[&str] = &["memcpy", "memmove", "memset", "malloc", "calloc", "free"];

/// Why a function must not be traversed: GCC does not instrument it, or instruments it
/// itself, or reports it on its own.
#[derive(Debug, Clone, Default)]
pub struct Safety {
    /// Names declared transaction_safe, transaction_pure, transaction_may_cancel_outer or
    /// const, as found by the probe.
    pub declared_safe: HashSet<String>,
    /// The probe ran: names it did not confirm are unsafe. Without it, `__builtin_*`
    /// functions other than the string ones are assumed safe (most are const).
    pub probed: bool,
    pub wrapped: Vec<String>,
}

impl Safety {
    fn is_safe(&self, node: &Node) -> bool {
        let name = node.name.as_str();
        if GCC_TM_BUILTINS.contains(&name) || name.starts_with("_ITM_") || self.wrapped.iter().any(|w| w == name) {
            return true;
        }
        if self.declared_safe.contains(name) {
            return true;
        }
        !self.probed && node.decl.starts_with("__builtin_") && replacement(name).is_none() && fortified(name).is_none()
    }
}

/// What cannot be instrumented at the end of a chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Cause {
    /// A call to a function without a body here and without transaction_safe/pure.
    External(String),
    /// A call through a pointer.
    Indirect,
}

/// A chain of calls from a function GCC reported down to a root cause.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootCause {
    /// The functions from the reported one to the last one defined here (or to the
    /// external one, when GCC reported it directly).
    pub chain: Vec<String>,
    pub cause: Cause,
}

/// The root causes below each reported function, one per distinct (caller, cause) pair:
/// 52 errors naming the helpers above one `strlen` give one line. Chains are the
/// shortest ones, found breadth-first.
pub fn root_causes(graph: &CallGraph, reported: &[String], safety: &Safety) -> Vec<RootCause> {
    let mut out: Vec<RootCause> = Vec::new();
    let mut seen: HashSet<(String, String)> = HashSet::new();
    let mut push = |out: &mut Vec<RootCause>, chain: Vec<String>, cause: Cause| {
        let leaf = match &cause {
            Cause::External(n) => n.clone(),
            Cause::Indirect => "(pointer)".to_string(),
        };
        let caller = chain.iter().rev().find(|c| **c != leaf).cloned().unwrap_or_default();
        if seen.insert((caller, leaf)) {
            out.push(RootCause { chain, cause });
        }
    };
    let is_leaf = |i: usize| {
        let n: &Node = &graph.nodes[i];
        !n.body || replacement(&n.name).is_some() || fortified(&n.name).is_some()
    };
    // External functions that GCC named directly: after the chains, and only if no
    // chain already ends in them.
    let mut direct: Vec<String> = Vec::new();
    for name in reported {
        let plain = plain_name(name);
        let root = match graph.find(&plain) {
            Some(root) if !is_leaf(root) => root,
            Some(root) if safety.is_safe(&graph.nodes[root]) => continue,
            // Not in the graph, or without a body here. Without a graph (C++, several
            // sources), only names known to be libc's are blamed: the others may be
            // helpers defined here, which are not the root cause.
            _ => {
                let known = replacement(&plain).is_some() || fortified(&plain).is_some();
                if !GCC_TM_BUILTINS.contains(&plain.as_str()) && (known || !graph.nodes.is_empty()) {
                    direct.push(plain);
                }
                continue;
            }
        };
        let mut parent: HashMap<usize, usize> = HashMap::new();
        let mut visited = HashSet::from([root]);
        let mut queue = VecDeque::from([root]);
        let mut found: Vec<(usize, Cause)> = Vec::new();
        let mut indirect: Vec<usize> = Vec::new();
        while let Some(i) = queue.pop_front() {
            let node = &graph.nodes[i];
            if node.indirect {
                indirect.push(i);
            }
            for &c in &node.calls {
                let callee = &graph.nodes[c];
                if safety.is_safe(callee) || !visited.insert(c) {
                    continue;
                }
                parent.insert(c, i);
                if is_leaf(c) {
                    found.push((c, Cause::External(callee.name.clone())));
                } else {
                    queue.push_back(c);
                }
            }
        }
        let chain_to = |end: usize| {
            let mut chain = vec![graph.nodes[end].name.clone()];
            let mut at = end;
            while let Some(&p) = parent.get(&at) {
                chain.push(graph.nodes[p].name.clone());
                at = p;
            }
            chain.reverse();
            chain
        };
        if found.is_empty() {
            // Only calls through pointers (or asm, which the graph does not show) remain.
            for i in indirect {
                push(&mut out, chain_to(i), Cause::Indirect);
            }
        }
        for (leaf, cause) in found {
            push(&mut out, chain_to(leaf), cause);
        }
    }
    for name in direct {
        if !out.iter().any(|c| c.cause == Cause::External(name.clone())) {
            push(&mut out, vec![name.clone()], Cause::External(name));
        }
    }
    out
}

impl RootCause {
    /// The line `lockstep cc` prints, e.g. "handle_get -> parse_key -> strlen: strlen is
    /// not transaction-safe; use sei_strlen (sei.h)".
    pub fn describe(&self) -> String {
        let chain = self.chain.join(" -> ");
        match &self.cause {
            Cause::Indirect => format!(
                "{chain} -> (call through a pointer): declare the pointer type and the functions it points \
                 to SEI_SAFE"
            ),
            Cause::External(name) => {
                let fix = match (fortified(name), replacement(name)) {
                    (Some(base), Some(sei)) => format!(
                        "is _FORTIFY_SOURCE's checking {base}, which is not transaction-safe; use {sei} (sei.h), \
                         or build with -U_FORTIFY_SOURCE"
                    ),
                    (Some(base), None) => format!(
                        "is _FORTIFY_SOURCE's checking {base}, which is not transaction-safe; build with \
                         -U_FORTIFY_SOURCE"
                    ),
                    (None, Some(sei)) => format!("is not transaction-safe; use {sei} (sei.h)"),
                    (None, None) => "is not transaction-safe and sei.h has no replacement; move the call out of \
                                     the handler, or declare the function SEI_SAFE if it is yours"
                        .to_string(),
                };
                if self.chain.len() == 1 {
                    format!("{name} {fix}")
                } else {
                    format!("{chain}: {name} {fix}")
                }
            }
        }
    }
}

/// Chains shown per root cause; the others are summed up in one line, so that a
/// handler whose twenty helpers each call strlen gets four lines, not twenty.
const CHAINS_PER_CAUSE: usize = 3;

/// The lines for all root causes, grouped by cause in order of first appearance.
pub fn describe_all(causes: &[RootCause]) -> Vec<String> {
    let mut order: Vec<&Cause> = Vec::new();
    for c in causes {
        if !order.contains(&&c.cause) {
            order.push(&c.cause);
        }
    }
    let mut lines = Vec::new();
    for cause in order {
        let group: Vec<&RootCause> = causes.iter().filter(|c| &c.cause == cause).collect();
        lines.extend(group.iter().take(CHAINS_PER_CAUSE).map(|c| c.describe()));
        if group.len() > CHAINS_PER_CAUSE {
            let rest = &group[CHAINS_PER_CAUSE..];
            let callers: Vec<&str> = rest
                .iter()
                .filter_map(|c| c.chain.iter().rev().nth(1).map(String::as_str))
                .take(5)
                .collect();
            let what = match cause {
                Cause::External(name) => name.as_str(),
                Cause::Indirect => "a call through a pointer",
            };
            let more = if rest.len() > callers.len() { ", ..." } else { "" };
            lines.push(format!(
                "{} more chains end in {what} (called from {}{more})",
                rest.len(),
                callers.join(", ")
            ));
        }
    }
    lines
}

/// The closing hint after the root causes.
pub const WAYS_OUT: &str = "other ways out: SEI_PURE on a helper that only reads the message and writes its \
                            caller's locals (it is then not instrumented), SEI_SAFE on functions defined in other \
                            files (docs/sei.md, step 4)";

// ---------------------------------------------------------------------------------------
// Re-running the compiler to find the root causes.

/// Options that take the next argument as their value (GCC's spelling).
const TAKES_VALUE: &[&str] = &[
    "-o",
    "-x",
    "-I",
    "-D",
    "-U",
    "-include",
    "-imacros",
    "-iquote",
    "-isystem",
    "-idirafter",
    "-iprefix",
    "-iwithprefix",
    "-iwithprefixbefore",
    "-isysroot",
    "-imultilib",
    "-MF",
    "-MT",
    "-MQ",
    "-L",
    "-l",
    "-T",
    "-u",
    "-z",
    "-Xlinker",
    "-Xassembler",
    "-Xpreprocessor",
    "-aux-info",
    "-dumpdir",
    "-dumpbase",
    "-dumpbase-ext",
    "--param",
    "-wrapper",
    "-specs",
];

/// Extensions of the C and C++ sources that gcc and g++ compile.
const SOURCE_EXTENSIONS: &[&str] = &["c", "cc", "cp", "cxx", "cpp", "CPP", "c++", "C"];

/// The C and C++ source files of an invocation (by extension; `-x` is not followed).
pub fn sources(args: &[OsString]) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if std::mem::take(&mut skip) {
            continue;
        }
        let text = a.to_string_lossy();
        if TAKES_VALUE.contains(&text.as_ref()) {
            skip = true;
            continue;
        }
        let ext = Path::new(a).extension().and_then(OsStr::to_str);
        if !text.starts_with('-') && ext.is_some_and(|e| SOURCE_EXTENSIONS.contains(&e)) {
            out.push(PathBuf::from(a));
        }
    }
    out
}

/// True if the invocation reads a source from standard input, which a retry cannot
/// read again.
pub fn reads_stdin(args: &[OsString]) -> bool {
    args.iter().any(|a| a == "-")
}

/// The arguments of a re-run that must leave no trace: no output file, no dependency
/// file (a re-run of a probe would list a temporary file in it), no saved temporaries,
/// no compile-only or link step of its own.
fn analysis_args(args: &[OsString], source: &Path, replace_with: Option<&Path>) -> Vec<OsString> {
    const DROP_WITH_VALUE: &[&str] = &["-o", "-MF", "-MT", "-MQ", "-dumpdir", "-dumpbase", "-dumpbase-ext"];
    const DROP: &[&str] = &["-c", "-S", "-E", "-MD", "-MMD", "-MP", "-M", "-MM", "-MG", "-pipe"];
    let mut out = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        let text = a.to_string_lossy();
        if DROP_WITH_VALUE.contains(&text.as_ref()) {
            it.next();
            continue;
        }
        if DROP.contains(&text.as_ref())
            || (text.starts_with("-o") && text.len() > 2)
            || (text.starts_with("-M") && text.len() > 3 && ["-MF", "-MT", "-MQ"].iter().any(|p| text.starts_with(p)))
            || text.starts_with("-Wp,-M")
            || text.starts_with("-save-temps")
            || text.starts_with("-fdump-")
            || text.starts_with("-flto")
            || text.starts_with("-fdiagnostics-color")
        {
            continue;
        }
        if TAKES_VALUE.contains(&text.as_ref()) {
            out.push(a.clone());
            if let Some(v) = it.next() {
                out.push(v.clone());
            }
            continue;
        }
        if Path::new(a) == source {
            if let Some(r) = replace_with {
                out.push(r.as_os_str().to_owned());
                continue;
            }
        }
        out.push(a.clone());
    }
    out
}

/// A private temporary directory, removed when dropped.
struct TempDir(PathBuf);

impl TempDir {
    fn new() -> std::io::Result<TempDir> {
        static COUNT: AtomicU32 = AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "lockstep-cc-{}-{}",
            std::process::id(),
            COUNT.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir)?;
        Ok(TempDir(dir))
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        // (a temporary directory; the system cleans what is left)
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs a re-run quietly and returns its stderr (its status does not matter: the
/// cgraph dump is written even when the TM pass then reports errors).
fn quiet(mut cmd: Command) -> Option<String> {
    let out = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .output()
        .ok()?;
    Some(String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The call graph of `source`: the same compilation, to assembly in a temporary
/// directory, with `-fdump-ipa-cgraph`.
fn call_graph(lang: Lang, args: &[OsString], source: &Path, install: &Install, tmp: &Path) -> Option<CallGraph> {
    let mut rerun = analysis_args(args, source, None);
    rerun.extend(["-S".into(), "-o".into(), tmp.join("out.s").into_os_string()]);
    rerun.extend([
        "-fdump-ipa-cgraph".into(),
        "-dumpdir".into(),
        format!("{}/", tmp.display()).into(),
    ]);
    quiet(crate::command(lang, &rerun, install).ok()?)?;
    let dump = std::fs::read_dir(tmp)
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().ends_with(".cgraph"))?;
    let graph = CallGraph::parse(&std::fs::read_to_string(dump).ok()?);
    (!graph.nodes.is_empty()).then_some(graph)
}

/// The probe: a file that includes the source and then asks GCC, for each function,
/// `__builtin_has_attribute(f, transaction_safe)` and the like. A negative array size
/// (an error naming the array) marks the safe ones; names GCC cannot resolve stay unsafe.
pub fn probe_source(source: &Path, names: &[String]) -> Option<String> {
    let path = source.to_str()?;
    if path.contains(['"', '\\', '\n']) {
        return None;
    }
    let mut text = format!("#include \"{path}\"\n");
    for (i, name) in names.iter().enumerate() {
        let attrs = [
            "transaction_safe",
            "transaction_pure",
            "transaction_may_cancel_outer",
            "const",
        ];
        let test: Vec<String> = attrs
            .iter()
            .map(|a| format!("__builtin_has_attribute({name}, {a})"))
            .collect();
        text.push_str(&format!(
            "extern char __lockstep_probe_{i}[({}) ? -1 : 1];\n",
            test.join(" || ")
        ));
    }
    Some(text)
}

/// The probe's answer: indices of the names that are safe.
pub fn parse_probe(stderr: &str) -> HashSet<usize> {
    strip_ansi(stderr)
        .lines()
        .filter(|l| l.contains("negative"))
        .filter_map(|l| {
            let at = l.find("__lockstep_probe_")? + "__lockstep_probe_".len();
            let digits: String = l[at..].chars().take_while(char::is_ascii_digit).collect();
            digits.parse().ok()
        })
        .collect()
}

fn probe(
    lang: Lang,
    args: &[OsString],
    source: &Path,
    names: &[String],
    install: &Install,
    tmp: &Path,
) -> Option<HashSet<String>> {
    let absolute = std::env::current_dir().ok()?.join(source);
    let text = probe_source(&absolute, names)?;
    // The same extension, so that gcc and g++ pick the same language.
    let ext = source.extension().and_then(OsStr::to_str).unwrap_or("c");
    let file = tmp.join(format!("lockstep_probe.{ext}"));
    std::fs::write(&file, text).ok()?;
    let mut rerun = analysis_args(args, source, Some(&file));
    rerun.extend(["-fsyntax-only".into(), "-fmax-errors=0".into()]);
    let stderr = quiet(crate::command(lang, &rerun, install).ok()?)?;
    let safe = parse_probe(&stderr);
    Some(safe.into_iter().filter_map(|i| names.get(i).cloned()).collect())
}

/// The lines that explain GCC's "unsafe function call" errors in `stderr`: one per root
/// cause, then [`WAYS_OUT`]. Re-runs the compilation twice (call graph, probe) when it
/// has exactly one source file; otherwise explains what GCC named directly.
pub fn trace_unsafe_calls(lang: Lang, args: &[OsString], stderr: &str, install: &Install) -> Vec<String> {
    let reported = unsafe_calls(stderr);
    let mut lines = Vec::new();
    if !reported.is_empty() {
        let tmp = TempDir::new().ok();
        let sources = sources(args);
        let single = (sources.len() == 1 && !reads_stdin(args)).then(|| &sources[0]);
        let mut safety = Safety {
            wrapped: wrapped_by_header(),
            ..Safety::default()
        };
        let graph = match (&tmp, single) {
            (Some(tmp), Some(source)) => call_graph(lang, args, source, install, &tmp.0),
            _ => None,
        };
        if let (Some(graph), Some(tmp), Some(source)) = (&graph, &tmp, single) {
            let names: Vec<String> = graph
                .reachable(&reported)
                .into_iter()
                .map(|i| {
                    // C: the name as declared (`__builtin_snprintf`); C++: the plain name
                    // (an overloaded one is ambiguous, and stays unsafe).
                    let node = &graph.nodes[i];
                    let ident = |d: &str| !d.is_empty() && d.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
                    if ident(&node.decl) {
                        node.decl.clone()
                    } else {
                        node.name.clone()
                    }
                })
                .filter(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_alphanumeric() || c == '_'))
                .collect();
            if let Some(safe) = probe(lang, args, source, &names, install, &tmp.0) {
                safety.declared_safe = safe.iter().map(|d| plain_name(d)).collect();
                safety.probed = true;
            }
        }
        let empty = CallGraph::default();
        let causes = root_causes(graph.as_ref().unwrap_or(&empty), &reported, &safety);
        lines.extend(describe_all(&causes));
        if graph.is_none() && causes.len() < reported.len() {
            lines.push(
                "could not trace the calls below the functions GCC named (one source file per compilation is needed)"
                    .into(),
            );
        }
    }
    if has_unsafe_indirect_call(stderr) {
        lines.push("an indirect call in a handler needs a SEI_SAFE pointer type and SEI_SAFE targets".into());
    }
    if !lines.is_empty() {
        lines.push(WAYS_OUT.into());
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALWAYS_INLINE: &str = "ai.c: In function \u{2018}hash\u{2019}:\nai.c:2:55: error: inlining failed in \
        call to \u{2018}always_inline\u{2019} \u{2018}rot\u{2019}: \n    2 | static inline ...\nai.c:4:63: note: \
        called from here\n";

    #[test]
    fn an_always_inline_failure_with_an_empty_reason_is_recognised_and_others_are_not() {
        assert_eq!(tm_always_inline_failure(ALWAYS_INLINE).as_deref(), Some("rot"));
        let ascii = "x.c:1:2: error: inlining failed in call to 'always_inline' 'fmix32': \n";
        assert_eq!(tm_always_inline_failure(ascii).as_deref(), Some("fmix32"));
        let colour = "x.c:1:2: \u{1b}[01;31m\u{1b}[Kerror: \u{1b}[m\u{1b}[Kinlining failed in call to \
                      \u{2018}\u{1b}[01m\u{1b}[Kalways_inline\u{1b}[m\u{1b}[K\u{2019} \u{2018}\u{1b}[01m\u{1b}[Kf\
                      \u{1b}[m\u{1b}[K\u{2019}: \n";
        assert_eq!(tm_always_inline_failure(colour).as_deref(), Some("f"));
        let real = "x.c:1:2: error: inlining failed in call to 'always_inline' '_mulx_u64': target specific \
                    option mismatch\n";
        assert_eq!(tm_always_inline_failure(real), None);
        assert_eq!(next_remedy(ascii, &[]).map(|r| r.0), Some(Remedy::NoPureConst));
        assert_eq!(
            next_remedy(ascii, &[Remedy::NoPureConst]).map(|r| r.0),
            Some(Remedy::DropAlwaysInline)
        );
        assert_eq!(
            next_remedy(ascii, &[Remedy::NoPureConst, Remedy::DropAlwaysInline]),
            None
        );
    }

    #[test]
    fn a_crash_in_the_tm_passes_is_told_from_other_crashes() {
        let tm = "during GIMPLE pass: tmmark\nice.c: In function 'handle':\nice.c:8:5: internal compiler error: \
                  in requires_barrier, at trans-mem.cc:1538\n";
        let ice = internal_compiler_error(tm).unwrap();
        assert_eq!(ice.what, "in requires_barrier, at trans-mem.cc:1538");
        assert!(ice.in_tm);
        assert_eq!(next_remedy(tm, &[]).map(|r| r.0), Some(Remedy::NoIvopts));
        assert_eq!(next_remedy(tm, &[Remedy::NoIvopts]), None);
        let other = "during RTL pass: expand\nx.c:1:1: internal compiler error: Segmentation fault\n";
        assert!(!internal_compiler_error(other).unwrap().in_tm);
        assert_eq!(next_remedy(other, &[]), None);
        assert_eq!(internal_compiler_error("x.c:1:1: error: expected ';'\n"), None);
    }

    #[test]
    fn unsafe_calls_are_read_in_order_once_and_made_plain() {
        let text = "un.c:11:30: error: unsafe function call \u{2018}handle_get\u{2019} within atomic transaction\n\
                    un.c:4:59: error: unsafe function call 'strlen' within atomic transaction\n\
                    x.h:29:10: error: unsafe function call \u{2018}__builtin___memcpy_chk\u{2019} within atomic transaction\n\
                    un.c:11:30: error: unsafe function call 'handle_get.isra.0' within 'transaction_safe' function\n";
        assert_eq!(unsafe_calls(text), ["handle_get", "strlen", "__memcpy_chk"]);
        assert_eq!(plain_name("size_t ns::strlen(const char*)"), "strlen");
        assert_eq!(plain_name("__builtin_snprintf"), "snprintf");
    }

    const DUMP: &str = "Trivially needed symbols: handler/17 total/11\n\nInitial Symbol table:\n\n\
strlen/21 (strlen) @0x7f09bcfdf880\n  Type: function\n  Function flags:\n  Called by: key_len/12 \n  Calls: \n\
memcmp/19 (memcmp) @0x7f09bcfdf660\n  Type: function\n  Function flags:\n  Calls: \n\
memcpy/22 (memcpy) @0x7f09bcfdf661\n  Type: function\n  Function flags:\n  Calls: \n\
handler/17 (handler) @0x7f09bcfdf440\n  Type: function definition analyzed\n  Function flags: body\n  Calls: \
_ITM_commitTransaction/18 parse_key/13 handle_get/16 parse_key/13 handle_get/16 \n\
_ITM_commitTransaction/18 (__builtin__ITM_commitTransaction) @0x7f09bcfdf550\n  Type: function\n  Function flags:\n  Calls: \n\
handle_get/16 (handle_get) @0x7f09bcfdf330\n  Type: function definition analyzed\n  Function flags: body\n  Calls: \
cmp/15 parse_key/13 memcpy/22 pure_helper/20 via/23 \n\
cmp/15 (cmp) @0x7f09bcfdf220\n  Type: function definition analyzed\n  Function flags: body\n  Calls: memcmp/19 \n\
parse_key/13 (parse_key) @0x7f09bcfdf000\n  Type: function definition analyzed\n  Function flags: body\n  Calls: key_len/12 \n\
key_len/12 (key_len) @0x7f09bcf79ee0\n  Type: function definition analyzed\n  Function flags: body\n  Calls: strlen/21 \n\
pure_helper/20 (pure_helper) @0x7f09bcf79ee1\n  Type: function definition analyzed\n  Function flags: body\n  Calls: strlen/21 \n\
via/23 (via) @0x7f09bcf79ee2\n  Type: function definition analyzed\n  Function flags: body\n  Calls: \n   Indirect call\n\
total/11 (total) @0x7f09bcfd9380\n  Type: variable definition analyzed\n  Varpool flags:\n\n\
Removing unused symbols: vprintf/0\n\nReclaimed Symbol table:\n\nother/99 (other) @0x1\n  Function flags: body\n";

    #[test]
    fn the_call_graph_dump_is_parsed_up_to_the_end_of_the_initial_table() {
        let g = CallGraph::parse(DUMP);
        assert!(g.find("other").is_none());
        let handler = &g.nodes[g.find("handler").unwrap()];
        assert!(handler.body);
        assert_eq!(handler.calls.len(), 3, "{handler:?}");
        assert!(!g.nodes[g.find("strlen").unwrap()].body);
        assert_eq!(
            g.nodes[g.find("_ITM_commitTransaction").unwrap()].decl,
            "__builtin__ITM_commitTransaction"
        );
        assert!(g.nodes[g.find("via").unwrap()].indirect);
    }

    #[test]
    fn chains_reach_the_unsafe_libc_calls_and_skip_safe_functions() {
        let g = CallGraph::parse(DUMP);
        let safety = Safety {
            probed: true,
            declared_safe: HashSet::from(["pure_helper".to_string()]),
            ..Safety::default()
        };
        let reported: Vec<String> = ["handle_get", "parse_key", "key_len", "strlen"]
            .map(String::from)
            .to_vec();
        let causes = root_causes(&g, &reported, &safety);
        let lines: Vec<String> = causes.iter().map(|c| c.chain.join(" -> ")).collect();
        // One line per (caller, cause): key_len -> strlen is reported once, from handle_get.
        assert_eq!(
            lines,
            [
                "handle_get -> cmp -> memcmp",
                "handle_get -> parse_key -> key_len -> strlen"
            ]
        );
        let direct = root_causes(&g, &["strtol".to_string(), "memcpy".to_string()], &safety);
        assert_eq!(
            direct,
            [RootCause {
                chain: vec!["strtol".into()],
                cause: Cause::External("strtol".into())
            }]
        );
        // Without a graph, a name could be a helper defined here: only libc's are blamed.
        let blind = root_causes(
            &CallGraph::default(),
            &["helper".to_string(), "strlen".to_string()],
            &safety,
        );
        assert_eq!(
            blind,
            [RootCause {
                chain: vec!["strlen".into()],
                cause: Cause::External("strlen".into())
            }]
        );
        let only_pointer = root_causes(&g, &["via".to_string()], &safety);
        assert_eq!(
            only_pointer,
            [RootCause {
                chain: vec!["via".into()],
                cause: Cause::Indirect
            }]
        );
    }

    #[test]
    fn root_causes_name_the_sei_replacement_when_the_header_has_one() {
        let c = RootCause {
            chain: vec!["h".into(), "p".into(), "strlen".into()],
            cause: Cause::External("strlen".into()),
        };
        assert_eq!(
            c.describe(),
            "h -> p -> strlen: strlen is not transaction-safe; use sei_strlen (sei.h)"
        );
        assert_eq!(replacement("sprintf"), Some("sei_snprintf"));
        assert_eq!(replacement("__snprintf_chk"), Some("sei_snprintf"));
        assert_eq!(replacement("strtol"), None);
        let chk = RootCause {
            chain: vec!["__memcpy_chk".into()],
            cause: Cause::External("__memcpy_chk".into()),
        };
        assert!(chk.describe().contains("-U_FORTIFY_SOURCE"), "{}", chk.describe());
        assert!(wrapped_by_header().iter().any(|w| w == "send"));
    }

    #[test]
    fn many_chains_to_one_libc_call_are_summed_up() {
        let causes: Vec<RootCause> = (0..6)
            .map(|i| RootCause {
                chain: vec!["h".into(), format!("f{i}"), "strlen".into()],
                cause: Cause::External("strlen".into()),
            })
            .chain([RootCause {
                chain: vec!["memcmp".into()],
                cause: Cause::External("memcmp".into()),
            }])
            .collect();
        let lines = describe_all(&causes);
        assert_eq!(lines.len(), 5, "{lines:#?}");
        assert_eq!(lines[3], "3 more chains end in strlen (called from f3, f4, f5)");
        assert!(lines[4].starts_with("memcmp is not transaction-safe"));
    }

    #[test]
    fn analysis_reruns_leave_no_output_or_dependency_file_behind() {
        let args: Vec<OsString> = [
            "-O2",
            "-MT",
            "x.o",
            "-MD",
            "-MP",
            "-MF",
            ".deps/x.Tpo",
            "-Wp,-MMD,x.d",
            "-c",
            "-o",
            "x.o",
            "-I",
            "inc",
            "x.c",
            "-DX=1",
            "-fdiagnostics-color=always",
        ]
        .map(OsString::from)
        .to_vec();
        assert_eq!(sources(&args), [PathBuf::from("x.c")]);
        let probe = analysis_args(&args, Path::new("x.c"), Some(Path::new("/tmp/p.c")));
        let probe: Vec<String> = probe.iter().map(|a| a.to_string_lossy().into_owned()).collect();
        assert_eq!(probe, ["-O2", "-I", "inc", "/tmp/p.c", "-DX=1"]);
    }

    #[test]
    fn the_probe_marks_safe_names_with_a_negative_array_size() {
        let text = probe_source(Path::new("/src/x.c"), &["strlen".into(), "f".into()]).unwrap();
        assert!(text.starts_with("#include \"/src/x.c\"\n"));
        assert!(text.contains("extern char __lockstep_probe_1[(__builtin_has_attribute(f, transaction_safe)"));
        let err = "p.c:3:13: error: size of array \u{2018}__lockstep_probe_1\u{2019} is negative\n";
        assert_eq!(parse_probe(err), HashSet::from([1]));
        assert_eq!(probe_source(Path::new("/a\"b.c"), &[]), None);
    }
}
