//! Measured peak memory: each op's forward + backward runs in a child process of its own
//! (this binary, `--mem-child OP PATH`), which prints the growth of the CubeCL memory pool's
//! reserved bytes, a high-water mark since the pool keeps what it reserved.

use std::process::Command;

use burn::tensor::Tensor;

use super::dev::{self, B};
use super::{fwd_bwd, half_type, op_inputs, sync, Op, Shapes, OPS};

/// Child process: one op's pool growth over forward + backward, in bytes, on stdout.
pub(super) fn memory_child(op: Op, fused: bool, s: &Shapes) {
    let device = dev::memory_device();
    let client = Tensor::<B, 1>::zeros([1], &device)
        .into_primitive()
        .tensor()
        .client;
    let reserved = || {
        client
            .memory_usage()
            .map(|u| u.bytes_reserved)
            .expect("the device's memory usage")
    };
    let inputs = op_inputs(op, &device, s, half_type(&device));
    sync(&device);
    let before = reserved();
    fwd_bwd(&inputs, fused);
    sync(&device);
    println!("{}", reserved().saturating_sub(before));
}

/// One op's measured pool growth, from a child process given the same shape flags
/// (`shape_args`) as this one.
fn measure_memory(op: Op, fused: bool, shape_args: &[String]) -> u64 {
    let exe = std::env::current_exe().expect("path of this binary");
    let path = if fused { "fused" } else { "burn" };
    let out = Command::new(exe)
        .args(["--mem-child", op.name(), path])
        .args(shape_args)
        .output()
        .expect("start the memory child process");
    let text = String::from_utf8_lossy(&out.stdout);
    match text.trim().lines().last().map(str::parse::<u64>) {
        Some(Ok(bytes)) if out.status.success() => bytes,
        _ => panic!(
            "the {} memory child ({path}) failed ({}): {}{}",
            op.name(),
            out.status,
            text,
            String::from_utf8_lossy(&out.stderr)
        ),
    }
}

/// `(fused, burn)` measured bytes of every op.
pub(super) fn measure_all(shape_args: &[String]) -> Vec<(Op, u64, u64)> {
    OPS.into_iter()
        .map(|op| {
            let (fused, burn) = (
                measure_memory(op, true, shape_args),
                measure_memory(op, false, shape_args),
            );
            eprintln!(
                "{} fwd+bwd peak pool growth: fused {:.1} MiB, Burn {:.1} MiB",
                op.name(),
                mib(fused),
                mib(burn)
            );
            (op, fused, burn)
        })
        .collect()
}

pub(super) fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1048576.0
}
