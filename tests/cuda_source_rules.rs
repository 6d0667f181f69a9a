//! Rules for the kernel sources that the CPU tests cannot check by running them, because
//! Mesa's Vulkan driver forgives what CUDA does not (both were found on an H200, after every
//! lavapipe test had passed; `docs/decisions.md` has the story):
//!
//! 1. Output buffers are compact. On CUDA, Burn's `empty_device_dtype` and
//!    `full_device_dtype` pad rows to 256 bytes, so a buffer from them is not the row-major
//!    layout the kernels write. Only `cube::contiguous_full` may call `full_device_dtype` (it
//!    copies the result into a compact buffer), and nothing calls `empty_device_dtype`.
//! 2. No `&&` in front of an index. CubeCL evaluates both operands of `&&`, so
//!    `i < n && buf[i] > x` reads `buf[i]` for every `i`; out of a shared array that is an
//!    illegal address on CUDA, which Vulkan drivers clamp away.

use std::fs;
use std::path::{Path, PathBuf};

/// Every `.rs` file under `dir`, recursively, sorted.
fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(dir) = pending.pop() {
        for entry in fs::read_dir(&dir).expect("read source folder") {
            let path = entry.expect("source folder entry").path();
            if path.is_dir() {
                pending.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

/// `(file, line number, line)` of the crate's source lines that are code, not comments.
fn code_lines() -> Vec<(String, usize, String)> {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let files = rust_files(&src);
    assert!(files.len() > 10, "found only {} source files", files.len());
    files
        .iter()
        .flat_map(|path| {
            let name = path
                .strip_prefix(&src)
                .expect("under src")
                .display()
                .to_string();
            fs::read_to_string(path)
                .expect("read source file")
                .lines()
                .enumerate()
                .filter(|(_, line)| !line.trim_start().starts_with("//"))
                .map(|(i, line)| (name.clone(), i + 1, line.to_string()))
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Whether `line` has `&&` with an indexing `name[` after it.
fn indexes_after_and(line: &str) -> bool {
    line.split("&&").skip(1).any(|rhs| {
        rhs.char_indices()
            .any(|(i, c)| c == '[' && rhs[..i].ends_with(|p: char| p.is_alphanumeric() || p == '_'))
    })
}

#[test]
fn the_rule_checks_catch_the_patterns_they_forbid() {
    assert!(indexes_after_and(
        "if tid < stride && red[tid + stride] > red[tid] {"
    ));
    assert!(!indexes_after_and("let ok = row < seq_q && j < seq_k;"));
    assert!(!indexes_after_and("let x = [a && b, c];"));
}

#[test]
fn kernel_outputs_never_come_from_burns_padded_allocations() {
    let mut offenders = Vec::new();
    for (file, n, line) in code_lines() {
        let padded_empty = line.contains("empty_device_dtype(") || line.contains("empty_device::<");
        let padded_full = line.contains("full_device_dtype(") && file != "cube/mod.rs";
        if padded_empty || padded_full {
            offenders.push(format!("{file}:{n}: {}", line.trim()));
        }
    }
    assert!(
        offenders.is_empty(),
        "Burn's allocations pad rows on CUDA; use cube::output or cube::contiguous_full:\n{}",
        offenders.join("\n")
    );
}

#[test]
fn no_index_is_evaluated_behind_a_short_circuit_that_cubecl_does_not_make() {
    let offenders: Vec<String> = code_lines()
        .into_iter()
        .filter(|(file, _, line)| file.starts_with("cube/") && indexes_after_and(line))
        .map(|(file, n, line)| format!("{file}:{n}: {}", line.trim()))
        .collect();
    assert!(
        offenders.is_empty(),
        "CubeCL evaluates both operands of `&&`: guard the index with a nested `if`:\n{}",
        offenders.join("\n")
    );
}
