//! Rules for the CUDA-facing sources that the CPU tests cannot check by running them, because
//! Mesa's Vulkan driver and the CPU backends forgive what CUDA does not. Each was found on an
//! H200 after every CPU test had passed; `docs/decisions.md` has the story.
//!
//! 1. Buffers that kernels, NCCL or peer copies fill are compact. On CUDA, Burn's
//!    `empty_device_dtype` and `full_device_dtype` pad rows to 256 bytes, which is not the
//!    row-major layout those writers produce. Only `cube::contiguous_full` may call
//!    `full_device_dtype` (it copies the result into a compact buffer); nothing calls
//!    `empty_device_dtype`.
//! 2. No `&&` in front of an index in kernel code. CubeCL evaluates both operands of `&&`, so
//!    `i < n && buf[i] > x` reads `buf[i]` for every `i`; out of a shared array that is an
//!    illegal address on CUDA, which Vulkan drivers clamp away.
//! 3. No tensors of zero elements from Burn's `zeros`/`ones`/`full`: they launch a fill over
//!    a grid of zero blocks, which CUDA refuses. `model::params::no_elements` makes them
//!    without a kernel.

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

/// `(file, line number, line)` of the code lines (not comments) under `crate_dir/src`, with
/// `file` relative to the workspace root.
fn code_lines(crate_dir: &str) -> Vec<(String, usize, String)> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let files = rust_files(&root.join(crate_dir).join("src"));
    assert!(
        files.len() > 10,
        "{crate_dir}: found only {} source files",
        files.len()
    );
    files
        .iter()
        .flat_map(|path| {
            let name = path
                .strip_prefix(root)
                .expect("under the workspace")
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

/// Both crates whose code reaches CUDA.
fn all_code_lines() -> Vec<(String, usize, String)> {
    let mut lines = code_lines("cubecl-kernels");
    lines.extend(code_lines("burn-bfpp"));
    lines
}

/// Whether `line` has `&&` with an indexing `name[` after it.
fn indexes_after_and(line: &str) -> bool {
    line.split("&&").skip(1).any(|rhs| {
        rhs.char_indices()
            .any(|(i, c)| c == '[' && rhs[..i].ends_with(|p: char| p.is_alphanumeric() || p == '_'))
    })
}

/// Whether `line` makes a tensor of zero elements with a Burn fill.
fn fills_zero_elements(line: &str) -> bool {
    ["zeros([0", "ones([0", "full([0"]
        .iter()
        .any(|call| line.contains(call))
}

/// Fails listing `offenders` (as `file:line: code`) with `fix`, unless there are none.
fn assert_none(offenders: Vec<(String, usize, String)>, fix: &str) {
    let listed: Vec<String> = offenders
        .iter()
        .map(|(file, n, line)| format!("{file}:{n}: {}", line.trim()))
        .collect();
    assert!(listed.is_empty(), "{fix}:\n{}", listed.join("\n"));
}

#[test]
fn the_rule_checks_catch_the_patterns_they_forbid() {
    assert!(indexes_after_and(
        "if tid < stride && red[tid + stride] > red[tid] {"
    ));
    assert!(!indexes_after_and("let ok = row < seq_q && j < seq_k;"));
    assert!(!indexes_after_and("let x = [a && b, c];"));
    assert!(fills_zero_elements(
        "let empty = Tensor::<B, D>::zeros([0; D], &old.device())"
    ));
    assert!(!fills_zero_elements("Tensor::zeros([len - n], &device)"));
}

#[test]
fn device_buffers_never_come_from_burns_padded_allocations() {
    let offenders = all_code_lines()
        .into_iter()
        .filter(|(file, _, line)| {
            line.contains("empty_device_dtype(")
                || line.contains("empty_device::<")
                || (line.contains("full_device_dtype(") && file != "cubecl-kernels/src/cube/mod.rs")
        })
        .collect();
    assert_none(
        offenders,
        "Burn's allocations pad rows on CUDA; use empty_device_contiguous_dtype, \
         cube::output or cube::contiguous_full",
    );
}

#[test]
fn no_index_in_kernel_code_sits_behind_a_short_circuit_that_cubecl_does_not_make() {
    let offenders = code_lines("cubecl-kernels")
        .into_iter()
        .filter(|(file, _, line)| file.contains("/src/cube/") && indexes_after_and(line))
        .collect();
    assert_none(
        offenders,
        "CubeCL evaluates both operands of `&&`: guard the index with a nested `if`",
    );
}

#[test]
fn no_tensor_of_zero_elements_is_made_by_a_fill_kernel() {
    let offenders = all_code_lines()
        .into_iter()
        .filter(|(_, _, line)| fills_zero_elements(line))
        .collect();
    assert_none(
        offenders,
        "a fill over zero elements is a launch of zero blocks, which CUDA refuses; \
         use model::params::no_elements",
    );
}
