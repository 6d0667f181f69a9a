//! Reading the workspace's Rust sources as text, shared by the tests that check the shape of
//! the code (`module_graph.rs`, `public_api.rs`): module files, `use` trees, and lines with
//! the inline modules they sit in, `#[cfg(test)]` blocks and comments left out.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

/// One crate's source tree.
pub struct Tree {
    /// The crate's source folder.
    pub src: PathBuf,
    /// Its root file, relative to `src` (`lib.rs`, `main.rs`).
    pub root: &'static str,
}

impl Tree {
    /// The file of module `path` (`[]` is the crate root), if it is a file of its own.
    pub fn file(&self, path: &[String]) -> Option<PathBuf> {
        if path.is_empty() {
            return Some(self.src.join(self.root));
        }
        let base = path.iter().fold(self.src.clone(), |p, s| p.join(s));
        [base.with_extension("rs"), base.join("mod.rs")]
            .into_iter()
            .find(|f| f.is_file())
    }

    /// The module path of a file of this tree.
    pub fn module_of(&self, file: &Path) -> Vec<String> {
        let rel = file.strip_prefix(&self.src).expect("a file of this tree");
        let mut path: Vec<String> = rel
            .with_extension("")
            .iter()
            .map(|s| s.to_string_lossy().into_owned())
            .collect();
        if path.last().is_some_and(|s| s == "mod") || rel == Path::new(self.root) {
            path.pop();
        }
        path
    }
}

/// Text without `//` comments (doc comments name items they do not import).
pub fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Expands a `use` tree (`a::{b, c::{d, e as f}}`) into its paths (`a::b`, `a::c::d`, …).
pub fn expand_use(tree: &str) -> Vec<String> {
    expand_use_named(tree)
        .into_iter()
        .map(|(path, _)| path)
        .collect()
}

/// The same, each path with the name it is bound to (`a::c::e` as `f`).
pub fn expand_use_named(tree: &str) -> Vec<(String, String)> {
    let mut tree = tree.split_whitespace().collect::<Vec<_>>().join(" ");
    for (spaced, tight) in [
        (" ::", "::"),
        (":: ", "::"),
        ("{ ", "{"),
        (" {", "{"),
        (" }", "}"),
    ]
    .into_iter()
    .chain([("} ", "}"), (", ", ","), (" ,", ",")])
    {
        tree = tree.replace(spaced, tight);
    }
    let Some(open) = tree.find('{') else {
        let (path, alias) = match tree.split_once(" as ") {
            Some((path, alias)) => (path, Some(alias)),
            None => (tree.as_str(), None),
        };
        let name = alias.unwrap_or_else(|| path.rsplit("::").next().unwrap_or(path));
        return vec![(path.to_string(), name.to_string())];
    };
    let prefix = &tree[..open];
    let inner = &tree[open + 1..tree.len().saturating_sub(1)];
    let mut parts = Vec::new();
    let (mut depth, mut start) = (0, 0);
    for (i, c) in inner.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&inner[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    parts.push(&inner[start..]);
    parts
        .into_iter()
        .filter(|p| !p.is_empty())
        .flat_map(|p| expand_use_named(&format!("{prefix}{p}")))
        .collect()
}

/// The code of a file with its `#[cfg(test)] mod … { … }` blocks removed, each remaining line
/// with the inline modules (`mod name { … }`) it sits in.
pub fn lines_with_scope(text: &str) -> Vec<(String, Vec<String>)> {
    let mut out = Vec::new();
    let mut depth: i64 = 0;
    let mut inline: Vec<(i64, String)> = Vec::new();
    let mut skip_to: Option<i64> = None;
    let mut cfg_test = false;
    for line in text.lines() {
        let opens = line.matches('{').count() as i64 - line.matches('}').count() as i64;
        let t = line.trim();
        if let Some(level) = skip_to {
            depth += opens;
            if depth <= level {
                skip_to = None;
            }
            continue;
        }
        if t.starts_with("#[cfg(test)]") {
            cfg_test = true;
            continue;
        }
        let module = t
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub(super) ")
            .trim_start_matches("pub ")
            .strip_prefix("mod ")
            .and_then(|rest| rest.strip_suffix('{'))
            .map(|name| name.trim().to_string());
        if let Some(name) = module {
            if cfg_test {
                skip_to = Some(depth);
            } else {
                inline.push((depth, name));
            }
            depth += opens;
            cfg_test = false;
            continue;
        }
        if !t.starts_with("#[") && !t.is_empty() {
            cfg_test = false;
        }
        out.push((
            line.to_string(),
            inline.iter().map(|(_, n)| n.clone()).collect(),
        ));
        depth += opens;
        while inline.last().is_some_and(|(d, _)| depth <= *d) {
            inline.pop();
        }
    }
    out
}

/// A `use` declaration, whole across its lines.
pub struct UseStatement {
    /// The tree after `use`, up to the `;`.
    pub tree: String,
    /// The inline modules it sits in.
    pub scope: Vec<String>,
    /// What stands before `use`: empty, `pub`, `pub(crate)`, …; a re-export when not empty.
    pub visibility: String,
}

/// The `use` declarations of code lines.
pub fn use_statements(lines: &[(String, Vec<String>)]) -> Vec<UseStatement> {
    let mut out = Vec::new();
    let mut current: Option<UseStatement> = None;
    for (line, scope) in lines {
        let t = line.trim();
        let statement = match current.take() {
            Some(mut open) => {
                open.tree.push_str(t);
                open
            }
            None => {
                let Some(i) = t.find("use ") else { continue };
                let visibility = t[..i].trim();
                let is_visibility = visibility.is_empty()
                    || visibility == "pub"
                    || (visibility.starts_with("pub(") && visibility.ends_with(')'));
                if !is_visibility {
                    continue;
                }
                UseStatement {
                    tree: t[i + 4..].to_string(),
                    scope: scope.clone(),
                    visibility: visibility.to_string(),
                }
            }
        };
        match statement.tree.find(';') {
            Some(end) => out.push(UseStatement {
                tree: statement.tree[..end].to_string(),
                ..statement
            }),
            None => current = Some(statement),
        }
    }
    out
}

/// Absolute module path of `path` (segments) written in module `here`, or `None` when it
/// starts outside the crate (another crate, `std`).
pub fn absolute(tree: &Tree, here: &[String], path: &[String]) -> Option<Vec<String>> {
    let (first, rest) = path.split_first()?;
    let mut base: Vec<String> = match first.as_str() {
        "crate" => Vec::new(),
        "self" => here.to_vec(),
        "super" => here[..here.len().checked_sub(1)?].to_vec(),
        name => {
            let mut child = here.to_vec();
            child.push(name.to_string());
            tree.file(&child)?;
            return Some([child, rest.to_vec()].concat());
        }
    };
    let mut rest = rest;
    while rest.first().is_some_and(|s| s == "super") {
        base.pop();
        rest = &rest[1..];
    }
    Some([base, rest.to_vec()].concat())
}

pub fn split(path: &str) -> Vec<String> {
    path.split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

pub fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot list {}: {e}", dir.display()))
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            if path.file_name().is_some_and(|n| n != "tests") {
                rust_files(&path, out);
            }
        } else if path.extension().is_some_and(|e| e == "rs")
            && !path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("tests"))
        {
            out.push(path);
        }
    }
}
