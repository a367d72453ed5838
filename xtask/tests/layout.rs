//! Every crate's shape, checked: no module imports another of its crate
//! that imports it back (directly or around a loop), and no source file
//! over 600 lines.
//!
//! Edges come from paths in code (comments skipped): `crate::a::b`,
//! `super::x`, `self::x`, and the items of their `{...}` groups, each
//! resolved to the deepest module file it names. A module's use of its
//! parent's items is an edge to the parent; declaring a child is not.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

const MAX_LINES: usize = 600;

fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// `src/a/b.rs` and `src/a/b/mod.rs` → ["a", "b"]; `src/lib.rs` and
/// `src/main.rs` → [].
fn module_of(src: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(src).unwrap().with_extension("");
    let mut parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
    if parts.last().is_some_and(|p| p == "mod" || p == "lib" || (p == "main" && parts.len() == 1)) {
        parts.pop();
    }
    parts
}

fn ident_end(s: &[u8], mut i: usize) -> usize {
    while i < s.len() && (s[i].is_ascii_alphanumeric() || s[i] == b'_') {
        i += 1;
    }
    i
}

/// The paths a line of code names, each as its segments (with a leading
/// `crate`, `super` or `self`).
fn paths_in(code: &str) -> Vec<Vec<String>> {
    let s = code.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < s.len() {
        let start_ok = i == 0 || !(s[i - 1].is_ascii_alphanumeric() || s[i - 1] == b'_' || s[i - 1] == b':');
        let head = ["crate::", "super::", "self::"].iter().find(|h| s[i..].starts_with(h.as_bytes()));
        let Some(head) = head.filter(|_| start_ok) else {
            i += 1;
            continue;
        };
        let mut path = vec![head.trim_end_matches(':').to_string()];
        let mut j = i + head.len();
        loop {
            if s[j..].starts_with(b"super::") && path.iter().all(|p| p == "super") {
                path.push("super".into());
                j += "super::".len();
                continue;
            }
            let end = ident_end(s, j);
            if end == j {
                break;
            }
            path.push(String::from_utf8_lossy(&s[j..end]).into_owned());
            j = end;
            if s[j..].starts_with(b"::{") {
                // One level of a group: each element's leading path.
                let mut depth = 0;
                let mut k = j + 3;
                let mut element_start = k;
                while k < s.len() {
                    match s[k] {
                        b'{' => depth += 1,
                        b'}' if depth == 0 => break,
                        b'}' => depth -= 1,
                        b',' if depth == 0 => {
                            out.push(extend(&path, &String::from_utf8_lossy(&s[element_start..k])));
                            element_start = k + 1;
                        }
                        _ => {}
                    }
                    k += 1;
                }
                out.push(extend(&path, &String::from_utf8_lossy(&s[element_start..k.min(s.len())])));
                path.clear();
                j = k;
                break;
            }
            if !s[j..].starts_with(b"::") {
                break;
            }
            j += 2;
        }
        if !path.is_empty() {
            out.push(path);
        }
        i = j.max(i + 1);
    }
    out
}

fn extend(prefix: &[String], element: &str) -> Vec<String> {
    let mut path = prefix.to_vec();
    for segment in element.trim().split("::") {
        let name: String = segment.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
        if name.is_empty() || name == "self" {
            break;
        }
        path.push(name);
    }
    path
}

/// The module a path lands in, as the deepest existing module it names.
fn resolve(from: &[String], path: &[String], modules: &BTreeSet<Vec<String>>) -> Vec<String> {
    let (base, rest): (Vec<String>, &[String]) = match path[0].as_str() {
        "crate" => (Vec::new(), &path[1..]),
        // `self::x` names a child, in a/mod.rs and in a.rs (a/x.rs) alike.
        "self" => (from.to_vec(), &path[1..]),
        _ => {
            let supers = path.iter().take_while(|p| *p == "super").count();
            (from[..from.len().saturating_sub(supers)].to_vec(), &path[supers..])
        }
    };
    let mut best = base.clone();
    let mut candidate = base;
    for segment in rest {
        candidate.push(segment.clone());
        if modules.contains(&candidate) {
            best = candidate.clone();
        } else {
            break;
        }
    }
    best
}

/// The crate's long files, and its import cycle if it has one; the
/// number of imports the scan found.
fn check_crate(src: &Path) -> (Vec<String>, Option<Vec<String>>, usize) {
    let mut all = Vec::new();
    files(src, &mut all);
    let modules: BTreeSet<Vec<String>> = all.iter().map(|f| module_of(src, f)).collect();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    let mut long = Vec::new();
    for file in &all {
        let text = std::fs::read_to_string(file).unwrap();
        let lines = text.lines().count();
        if lines > MAX_LINES {
            long.push(format!("{} ({lines} lines)", file.display()));
        }
        let from = module_of(src, file);
        // Unit tests (`#[cfg(test)] mod tests`, at the end of a file) are
        // not the crate's shape, and their `super::` is the file itself.
        let code = text.lines().take_while(|l| l.trim() != "#[cfg(test)]");
        for line in code.filter(|l| !l.trim_start().starts_with("//")) {
            // `use child::x` in a module file names its child like `self::`.
            let line = match line.trim_start().split_once("use ") {
                Some((vis, rest)) if vis.is_empty() || vis.starts_with("pub") => {
                    let first: String = rest.chars().take_while(|c| c.is_ascii_alphanumeric() || *c == '_').collect();
                    let child = [from.clone(), vec![first]].concat();
                    if modules.contains(&child) {
                        format!("use self::{rest}")
                    } else {
                        line.to_string()
                    }
                }
                _ => line.to_string(),
            };
            for path in paths_in(&line) {
                let to = resolve(&from, &path, &modules);
                if to != from && !to.is_empty() {
                    edges.entry(from.clone()).or_default().insert(to);
                }
            }
        }
    }
    let imports = edges.values().map(BTreeSet::len).sum::<usize>();

    let mut state = BTreeMap::new();
    for module in &modules {
        if !state.contains_key(module) {
            if let Some(cycle) = find_cycle(module, &edges, &mut state, &mut Vec::new()) {
                return (long, Some(cycle), imports);
            }
        }
    }
    (long, None, imports)
}

/// Depth-first search for a back edge from `node`; the loop it closes.
fn find_cycle(
    node: &Vec<String>,
    edges: &BTreeMap<Vec<String>, BTreeSet<Vec<String>>>,
    state: &mut BTreeMap<Vec<String>, u8>,
    stack: &mut Vec<Vec<String>>,
) -> Option<Vec<String>> {
    state.insert(node.clone(), 1);
    stack.push(node.clone());
    for next in edges.get(node).into_iter().flatten() {
        match state.get(next) {
            Some(1) => {
                let at = stack.iter().position(|n| n == next).unwrap();
                let mut cycle: Vec<String> = stack[at..].iter().map(|m| m.join("::")).collect();
                cycle.push(next.join("::"));
                return Some(cycle);
            }
            Some(_) => {}
            None => {
                if let Some(cycle) = find_cycle(next, edges, state, stack) {
                    return Some(cycle);
                }
            }
        }
    }
    stack.pop();
    state.insert(node.clone(), 2);
    None
}

#[test]
fn no_import_cycles_and_no_long_files_in_any_crate() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("crates");
    let mut problems = Vec::new();
    let mut imports = 0;
    let mut dirs: Vec<PathBuf> = std::fs::read_dir(&crates).unwrap().map(|e| e.unwrap().path()).collect();
    dirs.sort();
    for src in dirs.iter().map(|d| d.join("src")).filter(|s| s.is_dir()) {
        let (long, cycle, found) = check_crate(&src);
        imports += found;
        if !long.is_empty() {
            problems.push(format!("files over {MAX_LINES} lines: {long:?}"));
        }
        if let Some(cycle) = cycle {
            problems.push(format!("{}: module import cycle: {}", src.display(), cycle.join(" -> ")));
        }
    }
    assert!(imports > 200, "the scan found too few imports ({imports})");
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

#[test]
fn the_path_scanner_reads_groups_and_supers() {
    let paths = paths_in("use crate::protocol::{self, pages::shard_of, Digest}; let x = super::super::a::B;");
    assert!(paths.contains(&vec!["crate".into(), "protocol".into()]), "{paths:?}");
    assert!(paths.contains(&vec!["crate".into(), "protocol".into(), "pages".into(), "shard_of".into()]));
    assert!(paths.contains(&vec!["super".into(), "super".into(), "a".into(), "B".into()]));
    assert!(paths_in("let u = \"nbd://x\"; foo_crate::bar").is_empty());
}

/// bench/'s Python under the same rule: no file over 600 lines, and no
/// import cycle among its modules (`from tsubame_bench.a import x`,
/// `from tsubame_bench import a, b`, `import tsubame_bench.a`; an entry
/// script is a module too).
#[test]
fn no_import_cycles_and_no_long_files_in_bench() {
    let bench = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().join("bench");
    let mut all = Vec::new();
    python_files(&bench, &mut all);
    let name_of = |file: &Path| {
        let rel = file.strip_prefix(&bench).unwrap().with_extension("");
        let parts: Vec<String> = rel.iter().map(|p| p.to_string_lossy().into_owned()).collect();
        match parts.as_slice() {
            [package, init] if init == "__init__" => package.clone(),
            _ => parts.join("."),
        }
    };
    let modules: BTreeSet<String> = all.iter().map(|f| name_of(f)).collect();
    let mut long = Vec::new();
    let mut edges: BTreeMap<Vec<String>, BTreeSet<Vec<String>>> = BTreeMap::new();
    for file in &all {
        let text = std::fs::read_to_string(file).unwrap();
        let lines = text.lines().count();
        if lines > MAX_LINES {
            long.push(format!("{} ({lines} lines)", file.display()));
        }
        let from = name_of(file);
        for line in text.lines().map(str::trim_start) {
            let mut targets = Vec::new();
            if let Some(rest) = line.strip_prefix("from ") {
                if let Some((module, names)) = rest.split_once(" import ") {
                    targets.push(module.trim().to_string());
                    let names = names.trim_matches(|c| c == '(' || c == ')' || c == ' ');
                    targets.extend(names.split(',').map(|n| format!("{}.{}", module.trim(), n.trim())));
                }
            } else if let Some(rest) = line.strip_prefix("import ") {
                targets.extend(rest.split(',').map(|m| m.split(" as ").next().unwrap().trim().to_string()));
            }
            for target in targets.into_iter().filter(|t| modules.contains(t) && *t != from) {
                edges.entry(vec![from.clone()]).or_default().insert(vec![target]);
            }
        }
    }
    let mut state = BTreeMap::new();
    let mut cycle = None;
    for module in &modules {
        if cycle.is_none() && !state.contains_key(&vec![module.clone()]) {
            cycle = find_cycle(&vec![module.clone()], &edges, &mut state, &mut Vec::new());
        }
    }
    let imports = edges.values().map(BTreeSet::len).sum::<usize>();
    assert!(imports > 40, "the scan found too few imports in bench/ ({imports})");
    assert!(long.is_empty(), "files over {MAX_LINES} lines: {long:?}");
    assert!(cycle.is_none(), "bench/: module import cycle: {}", cycle.unwrap().join(" -> "));
}

fn python_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy();
        if path.is_dir() && !name.starts_with('.') && name != "__pycache__" {
            python_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "py") {
            out.push(path);
        }
    }
}
