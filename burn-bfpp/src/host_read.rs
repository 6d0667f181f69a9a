//! The one place where this crate reads tensor values back from a device.
//!
//! A read of device memory (`into_data`, `into_scalar` and the like) waits for every kernel
//! queued before it: on a GPU it is a host synchronisation, and one per micro-batch stalls the
//! pipeline. So every such read of the engine, the optimizer and the communicators goes
//! through [`read`], which counts it on the calling thread (a rank runs on one thread, so the
//! count is the rank's), and `clippy.toml` forbids Burn's read methods everywhere else in the
//! crate: a new read cannot bypass the count. The engine reports the counts of each step as
//! `host_reads_per_step` and `host_transfer_reads`.
//!
//! Reads are counted by purpose ([`ReadPurpose`]): a value the engine itself needs on the host
//! (the step's losses and gradient norm) is a synchronisation the engine chose, and the test
//! suite holds it to a fixed number per step; the payload of a host transport (a CPU rank's
//! send or its share of a host collective) is the transport's work, counted apart, and goes
//! away on transports that move device buffers (NCCL).

use std::cell::Cell;

use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::{BasicOps, Tensor, TensorData};

/// Why a tensor is read to the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ReadPurpose {
    /// A value the engine or the optimizer needs on the host: the step's loss, gradient norm
    /// and non-finite flags, a checkpoint.
    Sync,
    /// The payload of a host transport: a point-to-point send, a contribution to a host
    /// collective, a move between devices through host memory.
    Transfer,
}

/// Reads counted on one thread since it started (see [`counts`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct HostReads {
    /// Reads of values the engine needs on the host ([`ReadPurpose::Sync`]).
    pub sync: u64,
    /// Reads that are the payload of a host transport ([`ReadPurpose::Transfer`]).
    pub transfer: u64,
}

impl HostReads {
    /// The reads made between `earlier` and `self` (two readings of [`counts`] on one
    /// thread).
    pub fn since(self, earlier: HostReads) -> HostReads {
        HostReads {
            sync: self.sync.saturating_sub(earlier.sync),
            transfer: self.transfer.saturating_sub(earlier.transfer),
        }
    }
}

thread_local! {
    static COUNTS: Cell<HostReads> = const { Cell::new(HostReads { sync: 0, transfer: 0 }) };
}

/// The reads this thread has made so far.
pub(crate) fn counts() -> HostReads {
    COUNTS.with(Cell::get)
}

/// Reads `tensor` to the host, counting the read under `purpose`.
#[allow(clippy::disallowed_methods)] // the one sanctioned read
pub(crate) fn read<B, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    purpose: ReadPurpose,
) -> Result<TensorData, ExecutionError>
where
    B: Backend,
    K: BasicOps<B>,
{
    COUNTS.with(|c| {
        let mut n = c.get();
        match purpose {
            ReadPurpose::Sync => n.sync += 1,
            ReadPurpose::Transfer => n.transfer += 1,
        }
        c.set(n);
    });
    tensor.try_into_data()
}

#[cfg(test)]
mod tests {
    use burn::backend::Flex;

    use super::*;

    #[test]
    fn reads_are_counted_by_purpose_on_their_thread() {
        let device = Default::default();
        let before = counts();
        let t = Tensor::<Flex, 1>::from_floats([1.0, 2.0], &device);
        let data = read(t.clone(), ReadPurpose::Sync).expect("readable");
        assert_eq!(data.to_vec::<f32>().expect("f32"), vec![1.0, 2.0]);
        read(t.clone(), ReadPurpose::Transfer).expect("readable");
        read(t, ReadPurpose::Transfer).expect("readable");
        assert_eq!(
            counts().since(before),
            HostReads {
                sync: 1,
                transfer: 2
            }
        );
        // Another thread's reads are its own.
        std::thread::spawn(|| {
            let t = Tensor::<Flex, 1>::from_floats([3.0], &Default::default());
            read(t, ReadPurpose::Sync).expect("readable");
        })
        .join()
        .expect("the reader thread ran");
        assert_eq!(counts().since(before).sync, 1);
    }
}
