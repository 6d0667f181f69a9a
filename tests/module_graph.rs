//! The house has no circles: no source file of the workspace imports one that imports it back,
//! directly or around a loop (issue 42). A file "imports" another when one of its `use`
//! declarations or paths (`crate::…`, `super::…`, `self::…`, a child module's name) names an
//! item defined there; a module's `pub use` re-exports are its facade, not imports, and a
//! path through one is followed to the file that defines the item. Tests (`tests*.rs`,
//! `tests/` folders, `#[cfg(test)] mod` blocks) may import what they test and are left out.

mod source;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::path::{Path, PathBuf};

use source::use_statements;
use source::{absolute, expand_use, lines_with_scope, rust_files, split, strip_comments, Tree};

/// The crates of the workspace: source folder and root file.
const CRATES: [(&str, &str); 3] = [
    ("src", "main.rs"),
    ("burn-bfpp/src", "lib.rs"),
    ("cubecl-kernels/src", "lib.rs"),
];

/// The files of a crate and what each one imports.
struct Crate {
    tree: Tree,
    /// Per file: its re-exports, name → absolute path of the item.
    reexports: HashMap<PathBuf, HashMap<String, Vec<String>>>,
    /// Per file: absolute paths it names.
    uses: BTreeMap<PathBuf, Vec<Vec<String>>>,
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
            for statement in use_statements(&lines) {
                // A `pub use` at the top of a file is the file's facade; one inside an inline
                // module is that module's business and counted as an import of the file.
                let facade_line = !statement.visibility.is_empty() && statement.scope.is_empty();
                let module = [here.clone(), statement.scope].concat();
                for path in expand_use(&statement.tree) {
                    let Some(abs) = absolute(&tree, &module, &split(&path)) else {
                        continue;
                    };
                    if facade_line {
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
