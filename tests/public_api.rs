//! The public surface of the library crates is a reviewed list (issue 42): `docs/public-api.txt`
//! holds every item a user's crate can name in `burn_bfpp` and `cubecl_kernels` (modules,
//! types, traits, functions, constants, re-exports, and the `pub fn`s of inherent impls under
//! each public path of their type), with the features that gate its module left aside, but
//! without the test-only surface (items under `#[cfg(test)]` or the test-only feature
//! `fault-injection`, which a user's build never has). This
//! test derives the list from the sources and fails on any difference, naming the lines added
//! and removed, so that a change to the surface shows in review. After a deliberate change:
//!
//!     BFPP_BLESS_PUBLIC_API=1 cargo test --test public_api
//!
//! The list is read from the source text (a `pub` item of a public module, a `pub use` at a
//! public module's top, a `pub fn` in an `impl Type` block anywhere in the crate): methods are
//! put under every public path of an item of their type's name, and trait methods
//! and struct fields are not listed (the trait and the struct are).

mod source;

use std::collections::BTreeSet;
use std::path::Path;

use source::{
    expand_use_named, lines_with_scope, rust_files, strip_comments, use_statements, Tree,
};

/// The library crates: name in paths, source folder.
const LIBRARIES: [(&str, &str); 2] = [
    ("burn_bfpp", "burn-bfpp/src"),
    ("cubecl_kernels", "cubecl-kernels/src"),
];

/// The checked-in list, relative to the workspace.
const LIST: &str = "docs/public-api.txt";

/// A file's top-level code lines: not in an inline module or an item's body (test blocks and
/// comments are gone already).
fn top_level(lines: &[(String, Vec<String>)]) -> Vec<String> {
    let mut out = Vec::new();
    let mut depth: i64 = 0;
    for (line, scope) in lines {
        if depth == 0 && scope.is_empty() {
            out.push(line.trim().to_string());
        }
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
    }
    out
}

/// The test-only feature: what it gates is for the crates' own tests, not a user's build.
const TEST_ONLY_FEATURE: &str = "feature = \"fault-injection\"";

/// Whether an attribute makes the item it stands on test-only: `#[cfg(test)]`, or a `cfg`
/// that needs the test-only feature (not one that needs it absent).
fn test_only_attribute(t: &str) -> bool {
    t.starts_with("#[cfg(")
        && !t.contains("not(")
        && (t.starts_with("#[cfg(test)]") || t.contains(TEST_ONLY_FEATURE))
}

/// Code (without comments) less the items, fields and variants at a file's or a block's top
/// (depth 0 or 1) that a test-only attribute gates, their attributes included: an item ends
/// where its braces close, or at its `;` or `,` outside braces.
fn without_test_only(text: &str) -> String {
    let mut out = Vec::new();
    let mut depth: i64 = 0;
    let mut attributes: Vec<&str> = Vec::new();
    let mut test_only = false;
    // The brace balance of the item being left out, and whether it opened a brace.
    let mut skipping: Option<(i64, bool)> = None;
    for line in text.lines() {
        let t = line.trim();
        let opens = line.matches('{').count() as i64 - line.matches('}').count() as i64;
        if let Some((balance, braced)) = skipping.as_mut() {
            *balance += opens;
            *braced |= line.contains('{');
            depth += opens;
            if *balance <= 0 && (*braced || t.ends_with(';') || t.ends_with(',')) {
                skipping = None;
            }
            continue;
        }
        if t.starts_with("#[") && depth <= 1 {
            test_only |= test_only_attribute(t);
            attributes.push(line);
            continue;
        }
        if test_only && !t.is_empty() {
            attributes.clear();
            test_only = false;
            depth += opens;
            let braced = line.contains('{');
            if !(opens <= 0 && (braced || t.ends_with(';') || t.ends_with(','))) {
                skipping = Some((opens, braced));
            }
            continue;
        }
        out.append(&mut attributes);
        out.push(line);
        depth += opens;
    }
    out.append(&mut attributes);
    out.join("\n")
}

/// `pub` item declarations (not `pub(crate)`): kind and name.
fn declared_item(line: &str) -> Option<(&'static str, String)> {
    let rest = line.strip_prefix("pub ")?;
    let rest = rest
        .trim_start_matches("unsafe ")
        .trim_start_matches("async ")
        .trim_start_matches("extern \"C\" ");
    let kinds = [
        ("const fn ", "fn"),
        ("fn ", "fn"),
        ("struct ", "struct"),
        ("enum ", "enum"),
        ("trait ", "trait"),
        ("type ", "type"),
        ("const ", "const"),
        ("static ", "static"),
        ("union ", "union"),
        ("mod ", "mod"),
    ];
    kinds.iter().find_map(|(prefix, kind)| {
        let after = rest.strip_prefix(prefix)?;
        let name: String = after
            .chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect();
        (!name.is_empty()).then_some((*kind, name))
    })
}

/// Every `pub fn` of the inherent impls of a file: (type name, method name).
fn inherent_methods(text: &str) -> Vec<(String, String)> {
    let lines = lines_with_scope(&without_test_only(&strip_comments(text)));
    let mut out = Vec::new();
    let mut depth: i64 = 0;
    let mut header: Option<String> = None;
    let mut current: Option<String> = None;
    for (line, _) in lines {
        let t = line.trim();
        let before = depth;
        depth += line.matches('{').count() as i64 - line.matches('}').count() as i64;
        if before == 0 && (t.starts_with("impl") || header.is_some()) {
            let text = header.get_or_insert_with(String::new);
            text.push(' ');
            text.push_str(t);
            if depth > 0 {
                current = header.take().and_then(|h| impl_type(&h));
            }
            continue;
        }
        if depth == 0 {
            current = None;
        }
        if let (Some(ty), 1) = (&current, before) {
            if let Some(("fn", name)) = declared_item(t) {
                out.push((ty.clone(), name));
            }
        }
    }
    out
}

/// The type of an inherent impl header (`impl<B: Backend> Foo<B> where … {`), `None` for a
/// trait impl.
fn impl_type(header: &str) -> Option<String> {
    let head = header.split('{').next()?.split(" where").next()?.trim();
    let mut rest = head.strip_prefix("impl")?;
    if rest.starts_with('<') {
        let mut depth = 0;
        let end = rest.char_indices().find_map(|(i, c)| {
            match c {
                '<' => depth += 1,
                '>' => depth -= 1,
                _ => {}
            }
            (depth == 0).then_some(i)
        })?;
        rest = &rest[end + 1..];
    }
    if rest.contains(" for ") {
        return None;
    }
    let path = rest.trim().split('<').next()?.trim();
    Some(path.rsplit("::").next()?.to_string())
}

/// The public surface of one library crate, one line per item.
fn surface(krate: &str, src: &Path) -> BTreeSet<String> {
    let tree = Tree {
        src: src.to_path_buf(),
        root: "lib.rs",
    };
    let mut items = BTreeSet::new();
    let mut public: Vec<Vec<String>> = vec![Vec::new()];
    let mut seen = 0;
    while seen < public.len() {
        let module = public[seen].clone();
        seen += 1;
        let Some(file) = tree.file(&module) else {
            continue;
        };
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        let prefix = std::iter::once(krate.to_string())
            .chain(module.iter().cloned())
            .collect::<Vec<_>>()
            .join("::");
        let lines = lines_with_scope(&without_test_only(&strip_comments(&text)));
        for statement in use_statements(&lines) {
            if statement.visibility == "pub" && statement.scope.is_empty() {
                for (path, name) in expand_use_named(&statement.tree) {
                    items.insert(format!("{prefix}::{name} (use {path})"));
                }
            }
        }
        for line in top_level(&lines) {
            if let Some((kind, name)) = declared_item(&line) {
                if kind == "mod" {
                    let mut child = module.clone();
                    child.push(name.clone());
                    public.push(child);
                }
                items.insert(format!("{prefix}::{name} ({kind})"));
            }
        }
    }
    // Methods go under each public path of their type's name.
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let mut methods = BTreeSet::new();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", file.display()));
        methods.extend(inherent_methods(&text));
    }
    let types: Vec<(String, String)> = items
        .iter()
        .filter(|line| !line.ends_with("(fn)") && !line.ends_with("(mod)"))
        .filter_map(|line| {
            let (path, kind) = line.split_once(' ')?;
            // A re-export's type keeps its own name (`use a::Inner` bound as `Renamed`).
            let named = kind
                .strip_prefix("(use ")
                .and_then(|k| k.strip_suffix(')'))
                .unwrap_or(path);
            Some((named.rsplit("::").next()?.to_string(), path.to_string()))
        })
        .collect();
    for (ty, method) in methods {
        for (_, path) in types.iter().filter(|(name, _)| *name == ty) {
            items.insert(format!("{path}::{method} (method)"));
        }
    }
    items
}

#[test]
fn the_public_surface_is_the_reviewed_list() {
    let workspace = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut current = String::from(
        "# The public items of burn_bfpp and cubecl_kernels, one per line, generated by\n\
         # tests/public_api.rs (BFPP_BLESS_PUBLIC_API=1 cargo test --test public_api).\n",
    );
    let mut count = 0;
    for (krate, src) in LIBRARIES {
        for line in surface(krate, &workspace.join(src)) {
            current += &line;
            current.push('\n');
            count += 1;
        }
    }
    assert!(count > 100, "only {count} public items were found");
    let path = workspace.join(LIST);
    if std::env::var_os("BFPP_BLESS_PUBLIC_API").is_some() {
        std::fs::write(&path, &current).expect("the list is writable");
        return;
    }
    let recorded = std::fs::read_to_string(&path).unwrap_or_default();
    let lines = |text: &str| -> BTreeSet<String> {
        text.lines()
            .filter(|l| !l.starts_with('#'))
            .map(str::to_string)
            .collect()
    };
    let (now, before) = (lines(&current), lines(&recorded));
    let added: Vec<&String> = now.difference(&before).collect();
    let removed: Vec<&String> = before.difference(&now).collect();
    assert!(
        added.is_empty() && removed.is_empty(),
        "the public surface differs from {LIST} ({} items now): review the change, then \
         regenerate the list with `BFPP_BLESS_PUBLIC_API=1 cargo test --test public_api` and \
         commit it.\nadded:\n  {}\nremoved:\n  {}",
        now.len(),
        added
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n  "),
        removed
            .iter()
            .map(|s| s.as_str())
            .collect::<Vec<_>>()
            .join("\n  ")
    );
}

/// The reader itself on a small crate: public modules are followed, private ones and
/// `pub(crate)` items are not, re-exports and inherent methods are listed, trait impls not,
/// and neither are items under `#[cfg(test)]` or the test-only feature.
#[test]
fn the_reader_lists_what_a_user_can_name() {
    let dir = std::env::temp_dir().join(format!("bfpp-public-api-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let write = |rel: &str, text: &str| {
        std::fs::write(dir.join(rel), text).expect("write");
    };
    std::fs::create_dir_all(&dir).expect("mkdir");
    write(
        "lib.rs",
        "pub mod open;\nmod hidden;\npub use hidden::{Inner as Renamed, helper};\n\
         pub(crate) fn internal() {}\n",
    );
    write(
        "open.rs",
        "/// pub fn not_this() {}\npub struct Thing;\nimpl Thing {\n    pub fn make() -> Self { \
         Thing }\n    fn private(&self) {}\n    #[cfg(test)]\n    pub fn for_tests(&self) {}\n    \
         #[cfg(feature = \"fault-injection\")]\n    pub fn inject(\n        &self,\n    ) {\n    }\n}\n\
         impl Clone for Thing {\n    fn clone(&self) -> Self { Thing }\n}\n#[cfg(test)]\nmod tests \
         {\n    pub fn in_tests() {}\n}\n#[cfg(feature = \"fault-injection\")]\n#[derive(Debug)]\n\
         pub struct Fault {\n    pub rank: usize,\n}\n#[cfg(feature = \"fault-injection\")]\n\
         #[doc(hidden)]\npub mod testing {\n    pub use super::Thing;\n}\n\
         #[cfg(not(feature = \"fault-injection\"))]\npub enum NoFault {}\n",
    );
    write(
        "hidden.rs",
        "pub struct Inner;\nimpl<T> Inner\nwhere\n    T: Copy,\n{\n    pub fn get(&self) {}\n}\n\
         pub fn helper() {}\npub struct Unexported;\n",
    );
    let found: Vec<String> = surface("demo", &dir).into_iter().collect();
    assert_eq!(
        found,
        [
            "demo::Renamed (use hidden::Inner)",
            "demo::Renamed::get (method)",
            "demo::helper (use hidden::helper)",
            "demo::open (mod)",
            "demo::open::NoFault (enum)",
            "demo::open::Thing (struct)",
            "demo::open::Thing::make (method)",
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
}
