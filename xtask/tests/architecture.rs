//! docs/architecture.md's "Files" tree names every source file of every
//! crate, and nothing else: a file added without its line, or a line left
//! behind by a file that moved, fails here.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// The paths the tree names: a line at indent 0 is a crate's `src/`,
/// each two spaces deeper is a folder (`name/`) or a file inside the last
/// folder above it at one level less.
fn paths_in_tree(doc: &str) -> BTreeSet<String> {
    let block = doc.split("## Files").nth(1).expect("docs/architecture.md has a \"## Files\" section");
    let block = block.split("```\n").nth(1).expect("the Files section has a code block");
    let mut folders: Vec<String> = Vec::new();
    let mut paths = BTreeSet::new();
    for line in block.lines().filter(|l| !l.trim().is_empty()) {
        let indent = line.len() - line.trim_start().len();
        assert!(indent % 2 == 0, "odd indent in the Files tree: {line:?}");
        let depth = indent / 2;
        let name = line.split_whitespace().next().unwrap();
        assert!(depth <= folders.len(), "a line deeper than its folder in the Files tree: {line:?}");
        folders.truncate(depth);
        let path = format!("{}{name}", folders.concat());
        if name.ends_with('/') {
            folders.push(name.to_string());
        } else {
            assert!(name.ends_with(".rs"), "the Files tree names something not a source file: {line:?}");
            paths.insert(path);
        }
    }
    paths
}

fn source_files(dir: &Path, base: &Path, out: &mut BTreeSet<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            source_files(&path, base, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.insert(path.strip_prefix(base).unwrap().to_string_lossy().into_owned());
        }
    }
}

#[test]
fn the_files_tree_names_every_source_file_and_no_other() {
    let root = root();
    let doc = std::fs::read_to_string(root.join("docs/architecture.md")).unwrap();
    let named = paths_in_tree(&doc);
    let mut present = BTreeSet::new();
    for krate in std::fs::read_dir(root.join("crates")).unwrap() {
        let src = krate.unwrap().path().join("src");
        if src.is_dir() {
            source_files(&src, &root, &mut present);
        }
    }
    let unnamed: Vec<_> = present.difference(&named).collect();
    let gone: Vec<_> = named.difference(&present).collect();
    assert!(
        unnamed.is_empty() && gone.is_empty(),
        "docs/architecture.md's Files tree is out of date: add a line for {unnamed:?}; remove {gone:?}"
    );
}

#[test]
fn the_tree_is_read_as_nested_folders() {
    let doc = "## Files\n\n```\ncrates/a/src/\n  lib.rs   x\n  m/\n    mod.rs y\n    n/\n      k.rs z\n  b.rs w\n```\n";
    let expected = ["crates/a/src/b.rs", "crates/a/src/lib.rs", "crates/a/src/m/mod.rs", "crates/a/src/m/n/k.rs"];
    assert_eq!(paths_in_tree(doc), expected.iter().map(|s| s.to_string()).collect());
}
