//! [`LocalComm`]'s same-device handoff on a CubeCL backend (wgpu; on a machine without a GPU,
//! Mesa's lavapipe). Build with `--features wgpu`.
//!
//! CubeCL gives every thread its own stream, and memory belongs to the stream that allocated
//! it. When a rank hands a tensor to another thread and the receiver drops it while its
//! reading kernels still wait in the receiver's queue, the sender may reuse the memory and
//! have its writes reach the device first. This test builds exactly that interleaving.
// Tests read values freely; only burn-bfpp's own reads are counted (its clippy.toml).
#![allow(clippy::disallowed_methods)]
#![cfg(feature = "wgpu")]

use std::sync::mpsc;
use std::thread;

use burn::backend::Wgpu;
use burn::tensor::DType;
use burn::tensor::{Tensor, TensorData};
use burn_bfpp::comm::{CommConfig, Communicator, LocalComm, RankGrid};

type B = Wgpu;

const LEN: usize = 4096;

/// Rank 0 hands a tensor to rank 1 on the same device, with the kernels producing it still
/// queued. Rank 1 queues a kernel that reads it and drops its handle; rank 0 then allocates a
/// tensor of the same size, writes other values into it and synchronises. Rank 1's result must
/// still be computed from the values sent.
#[test]
fn a_handed_over_tensor_survives_the_senders_reuse_of_its_memory() {
    let grid = RankGrid::new(2, 1).expect("valid grid");
    let mut comms = LocalComm::<B>::create(grid, CommConfig::default()).into_iter();
    let (sender, receiver) = (comms.next().expect("rank 0"), comms.next().expect("rank 1"));
    let sent: Vec<f32> = (0..LEN).map(|i| (i % 251) as f32 + 1.0).collect();
    let expected: Vec<f32> = sent.iter().map(|v| v * 0.5 * 2.0).collect();
    let (dropped_tx, dropped_rx) = mpsc::channel::<()>();
    let (reused_tx, reused_rx) = mpsc::channel::<()>();

    let values = sent.clone();
    let rank0 = thread::spawn(move || {
        let device = sender.device().clone();
        // Sent while the kernel producing it may still wait in this thread's queue: the
        // receiver must see its result, not the memory before it ran.
        let t = Tensor::<B, 1>::from_data(TensorData::new(values, [LEN]), &device)
            .mul_scalar(0.5)
            .add_scalar(0.0);
        sender.send(1, 7, t).expect("send");
        dropped_rx.recv().expect("rank 1 signals");
        // Same size as the tensor handed over: the allocator hands its memory out again.
        for _ in 0..4 {
            let other =
                Tensor::<B, 1>::from_data(TensorData::new(vec![-5.0f32; LEN], [LEN]), &device);
            let _ = other.mul_scalar(3.0).into_data();
        }
        reused_tx.send(()).expect("rank 1 waits");
    });
    let rank1 = thread::spawn(move || {
        let g = receiver.recv::<1>(0, 7, [LEN], DType::F32).expect("recv");
        // A kernel reading the received tensor, queued but not yet run; then the handle goes.
        let doubled = g.clone().mul_scalar(2.0);
        drop(g);
        dropped_tx.send(()).expect("rank 0 waits");
        reused_rx.recv().expect("rank 0 signals");
        doubled.into_data().into_vec::<f32>().expect("f32 values")
    });
    rank0.join().expect("rank 0");
    let got = rank1.join().expect("rank 1");
    let wrong = got.iter().zip(&expected).filter(|(g, e)| g != e).count();
    assert_eq!(
        wrong,
        0,
        "{wrong} of {LEN} values of the received tensor were overwritten by the sender \
         (first values: {:?})",
        &got[..4]
    );
}
