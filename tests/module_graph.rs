//! The house has no circles: no source file of the workspace imports one that imports it back,
//! directly or around a loop (issue 42). A file "imports" another when one of its `use`
//! declarations or paths (`crate::…`, `super::…`, `self::…`, a child module's name) names an
//! item defined there; a module's `pub use` re-exports are its facade, not imports, and a
//! path through one is followed to the file that defines the item. Tests (`tests*.rs`,
//! `tests/` folders, `#[cfg(test)] mod` blocks) may import what they test and are left out.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// The crates of the workspace: source folder and root file.
const CRATES: [(&str, &str); 3] = [
    ("src", "main.rs"),
    ("burn-bfpp/src", "lib.rs"),
    ("cubecl-kernels/src", "lib.rs"),
];

/// One crate's source tree.
struct Tree {
    src: PathBuf,
    root: &'static str,
}

impl Tree {
    /// The file of module `path` (`[]` is the crate root), if it is a file of its own.
    fn file(&self, path: &[String]) -> Option<PathBuf> {
        if path.is_empty() {
            return Some(self.src.join(self.root));
        }
        let base = path.iter().fold(self.src.clone(), |p, s| p.join(s));
        [base.with_extension("rs"), base.join("mod.rs")]
            .into_iter()
            .find(|f| f.is_file())
    }

    /// The module path of a file of this tree.
    fn module_of(&self, file: &Path) -> Vec<String> {
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
fn strip_comments(text: &str) -> String {
    text.lines()
        .map(|l| match l.find("//") {
            Some(i) => &l[..i],
            None => l,
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// Expands a `use` tree (`a::{b, c::{d, e as f}}`) into its paths (`a::b`, `a::c::d`, …).
fn expand_use(tree: &str) -> Vec<String> {
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
        let path = tree.split(" as ").next().unwrap_or("");
        return vec![path.to_string()];
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
        .flat_map(|p| expand_use(&format!("{prefix}{p}")))
        .collect()
}

/// The code of a file with its `#[cfg(test)] mod … { … }` blocks removed, each remaining line
/// with the inline modules (`mod name { … }`) it sits in.
fn lines_with_scope(text: &str) -> Vec<(String, Vec<String>)> {
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

/// The `use` declarations (whole, across lines) of code lines, each with its scope and
/// whether it is a re-export.
fn use_statements(lines: &[(String, Vec<String>)]) -> Vec<(String, Vec<String>, bool)> {
    let mut out = Vec::new();
    let mut current: Option<(String, Vec<String>, bool)> = None;
    for (line, scope) in lines {
        let t = line.trim();
        if current.is_none() {
            let reexport =
                t.starts_with("pub use ") || (t.starts_with("pub(") && t.contains(") use "));
            let Some(i) = t.find("use ") else { continue };
            if !(t.starts_with("use ") || reexport) {
                continue;
            }
            current = Some((t[i + 4..].to_string(), scope.clone(), reexport));
        } else if let Some((text, _, _)) = current.as_mut() {
            text.push_str(t);
        }
        if let Some((text, scope, reexport)) = current.take() {
            match text.find(';') {
                Some(end) => out.push((text[..end].to_string(), scope, reexport)),
                None => current = Some((text, scope, reexport)),
            }
        }
    }
    out
}

/// Absolute module path of `path` (segments) written in module `here`, or `None` when it
/// starts outside the crate (another crate, `std`).
fn absolute(tree: &Tree, here: &[String], path: &[String]) -> Option<Vec<String>> {
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

/// The files of a crate and what each one imports.
struct Crate {
    tree: Tree,
    /// Per file: its re-exports, name → absolute path of the item.
    reexports: HashMap<PathBuf, HashMap<String, Vec<String>>>,
    /// Per file: absolute paths it names.
    uses: BTreeMap<PathBuf, Vec<Vec<String>>>,
}

fn split(path: &str) -> Vec<String> {
    path.split("::")
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
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

impl Crate {
    fn read(src: PathBuf, root: &'static str) -> Crate {
        let tree = Tree { src, root };
        let mut files = Vec::new();
        rust_files(&tree.src, &mut files);
        let mut reexports = HashMap::new();
        let mut uses = BTreeMap::new();
        for file in files {
            let text = std::fs::read_to_string(&file)
                .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
            let here = tree.module_of(&file);
            let lines = lines_with_scope(&strip_comments(&text));
            let mut facade = HashMap::new();
            let mut named = Vec::new();
            for (statement, scope, reexport) in use_statements(&lines) {
                let module = [here.clone(), scope].concat();
                for path in expand_use(&statement) {
                    let Some(abs) = absolute(&tree, &module, &split(&path)) else {
                        continue;
                    };
                    if reexport && scope_is_file(&module, &here) {
                        if let Some(name) = abs.last().filter(|n| n.as_str() != "*") {
                            facade.insert(name.clone(), abs.clone());
                        }
                    } else {
                        named.push(abs);
                    }
                }
            }
            // Paths written in code: `crate::a::b`, `super::a::b(…)`, `self::a::B`.
            for (line, scope) in &lines {
                let t = line.trim_start();
                if t.starts_with("use ") || t.starts_with("pub") && t.contains("use ") {
                    continue;
                }
                let module = [here.clone(), scope.clone()].concat();
                for start in ["crate::", "super::", "self::"] {
                    for (i, _) in line.match_indices(start) {
                        let boundary = line[..i]
                            .chars()
                            .last()
                            .is_none_or(|c| !(c.is_alphanumeric() || c == '_'));
                        if !boundary {
                            continue;
                        }
                        let path: String = line[i..]
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
                            .collect();
                        if let Some(abs) = absolute(&tree, &module, &split(&path)) {
                            named.push(abs);
                        }
                    }
                }
            }
            reexports.insert(file.clone(), facade);
            uses.insert(file, named);
        }
        Crate {
            tree,
            reexports,
            uses,
        }
    }

    /// The file that defines what `path` names: the deepest module file on the path, then
    /// through that module's re-exports.
    fn defining_file(&self, path: &[String]) -> Option<PathBuf> {
        let mut path = path.to_vec();
        for _ in 0..8 {
            let (file, rest) = (0..=path.len())
                .rev()
                .find_map(|k| self.tree.file(&path[..k]).map(|f| (f, &path[k..])))?;
            let next = rest
                .first()
                .and_then(|name| self.reexports.get(&file)?.get(name));
            match next {
                Some(target) => path = [target.clone(), rest[1..].to_vec()].concat(),
                None => return Some(file),
            }
        }
        None
    }

    /// File → files it imports (itself left out).
    fn graph(&self) -> BTreeMap<PathBuf, BTreeSet<PathBuf>> {
        self.uses
            .iter()
            .map(|(file, paths)| {
                let targets = paths
                    .iter()
                    .filter_map(|p| self.defining_file(p))
                    .filter(|t| t != file)
                    .collect();
                (file.clone(), targets)
            })
            .collect()
    }
}

/// A `pub use` at the top of a file is the file's facade; one inside an inline module is
/// that module's business and counted as an import of the file.
fn scope_is_file(module: &[String], here: &[String]) -> bool {
    module.len() == here.len()
}

/// Every set of files that import each other around a loop (strongly connected components
/// of more than one file), found with Tarjan's algorithm.
fn circles(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>) -> Vec<Vec<PathBuf>> {
    struct State<'g> {
        graph: &'g BTreeMap<PathBuf, BTreeSet<PathBuf>>,
        index: HashMap<&'g PathBuf, usize>,
        low: HashMap<&'g PathBuf, usize>,
        stack: Vec<&'g PathBuf>,
        on_stack: BTreeSet<&'g PathBuf>,
        found: Vec<Vec<PathBuf>>,
    }
    fn visit<'g>(s: &mut State<'g>, v: &'g PathBuf) {
        let n = s.index.len();
        s.index.insert(v, n);
        s.low.insert(v, n);
        s.stack.push(v);
        s.on_stack.insert(v);
        let graph = s.graph;
        for w in graph.get(v).into_iter().flatten() {
            let Some((w, _)) = graph.get_key_value(w) else {
                continue;
            };
            if !s.index.contains_key(w) {
                visit(s, w);
                let low = s.low[v].min(s.low[w]);
                s.low.insert(v, low);
            } else if s.on_stack.contains(w) {
                let low = s.low[v].min(s.index[w]);
                s.low.insert(v, low);
            }
        }
        if s.low[v] == s.index[v] {
            let mut component = Vec::new();
            while let Some(w) = s.stack.pop() {
                s.on_stack.remove(w);
                component.push(w.clone());
                if w == v {
                    break;
                }
            }
            if component.len() > 1 {
                component.sort();
                s.found.push(component);
            }
        }
    }
    let mut state = State {
        graph,
        index: HashMap::new(),
        low: HashMap::new(),
        stack: Vec::new(),
        on_stack: BTreeSet::new(),
        found: Vec::new(),
    };
    for v in graph.keys() {
        if !state.index.contains_key(v) {
            visit(&mut state, v);
        }
    }
    state.found
}

fn report(graph: &BTreeMap<PathBuf, BTreeSet<PathBuf>>, found: &[Vec<PathBuf>]) -> String {
    found
        .iter()
        .map(|files| {
            let members: BTreeSet<&PathBuf> = files.iter().collect();
            let lines: Vec<String> = files
                .iter()
                .map(|f| {
                    let to: Vec<String> = graph[f]
                        .iter()
                        .filter(|t| members.contains(t))
                        .map(|t| t.display().to_string())
                        .collect();
                    format!("  {} imports {}", f.display(), to.join(", "))
                })
                .collect();
            format!("a circle of {} files:\n{}", files.len(), lines.join("\n"))
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn no_file_imports_one_that_imports_it_back() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut problems = Vec::new();
    let mut files = 0;
    for (src, root) in CRATES {
        let krate = Crate::read(workspace.join(src), root);
        let graph = krate.graph();
        files += graph.len();
        let found = circles(&graph);
        if !found.is_empty() {
            problems.push(report(&graph, &found));
        }
    }
    assert!(files > 100, "only {files} source files were read");
    assert!(
        problems.is_empty(),
        "files that import each other (move the shared item into a module both can import \
         from below):\n{}",
        problems.join("\n")
    );
}

/// The checker itself: a small tree with a circle through a re-export and one through a
/// path in code is reported, and the same tree untied is not.
#[test]
fn the_checker_finds_circles_through_reexports_and_paths() {
    let dir = std::env::temp_dir().join(format!("bfpp-module-graph-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let write = |rel: &str, text: &str| {
        let path = dir.join(rel);
        std::fs::create_dir_all(path.parent().expect("has a parent")).expect("mkdir");
        std::fs::write(path, text).expect("write");
    };
    write("lib.rs", "mod a;\nmod b;\nmod c;\npub use a::Alpha;\n");
    // a ↔ b through lib.rs's re-export of Alpha; c names b in code only.
    write("a.rs", "use crate::b::Beta;\npub struct Alpha(Beta);\n");
    write(
        "b.rs",
        "use crate::{\n    Alpha,\n};\npub struct Beta;\nfn f() { crate::c::g(); }\n",
    );
    write(
        "c.rs",
        "pub fn g() { let _ = super::b::Beta; }\n#[cfg(test)]\nmod tests {\n    use crate::a::Alpha;\n}\n",
    );
    let graph = Crate::read(dir.clone(), "lib.rs").graph();
    let found = circles(&graph);
    assert_eq!(found.len(), 1, "{}", report(&graph, &found));
    let names: Vec<String> = found[0]
        .iter()
        .map(|f| f.file_name().expect("named").to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        ["a.rs", "b.rs", "c.rs"],
        "{}",
        report(&graph, &found)
    );
    // Untied: b names neither a nor c; c's test block, which names a, does not count.
    write("b.rs", "pub struct Beta;\n");
    let graph = Crate::read(dir.clone(), "lib.rs").graph();
    assert!(
        circles(&graph).is_empty(),
        "{}",
        report(&graph, &circles(&graph))
    );
    let _ = std::fs::remove_dir_all(&dir);
}
