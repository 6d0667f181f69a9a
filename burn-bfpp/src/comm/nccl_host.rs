//! What an NCCL communicator needs from the communicator it is layered on (the *host*
//! communicator: [`LocalComm`] for ranks that are threads, `MpiComm` for ranks that are
//! processes), and the start-up exchanges it runs over it: which GPU each member of a group
//! is on, and the NCCL unique id that rank 0 of the group creates for the others.
//!
//! Everything here is generic over the backend, so it is tested on the CPU; only the NCCL
//! calls themselves need a GPU.

use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use crate::host_read::{read, ReadPurpose};

use super::{first_shared_device, CommError, CommOp, Communicator, Group};
#[cfg(feature = "cuda")]
use super::{CommConfig, LocalComm};

/// Bytes in an NCCL unique id (`ncclUniqueId`).
pub const NCCL_ID_BYTES: usize = 128;

/// The host communicator an NCCL communicator is layered on: point-to-point transfers,
/// barriers and failure propagation stay with it, and before each NCCL call the members agree
/// through it on the call.
#[cfg(feature = "cuda")]
#[allow(private_bounds)] // the watchdog's needs are the crate's business
pub trait NcclHost<B: Backend>: Communicator<B> + super::watchdog::FailStop {
    /// Returns once every member of `group` called it with the same `action` and `shape`;
    /// fails (naming the peer) otherwise, like any collective.
    fn agree(&self, group: Group, action: CommOp, shape: &[usize]) -> Result<(), CommError>;
    /// Records `err` as this rank's failure, so that every other rank stops, and returns it.
    fn fail(&self, err: CommError) -> CommError;
    /// The world's configuration (its timeout bounds every NCCL call too).
    fn config(&self) -> CommConfig;
}

#[cfg(feature = "cuda")]
impl<B: Backend> NcclHost<B> for LocalComm<B> {
    fn agree(&self, group: Group, action: CommOp, shape: &[usize]) -> Result<(), CommError> {
        LocalComm::agree(self, group, action, shape)
    }
    fn fail(&self, err: CommError) -> CommError {
        LocalComm::fail(self, err)
    }
    fn config(&self) -> CommConfig {
        LocalComm::config(self)
    }
}

/// Longest shape [`agree_by_all_gather`] describes.
const MAX_DIMS: usize = 8;
/// Descriptor length: the action's hash and the rank count in 16-bit halves, each dimension
/// in two halves (f32 holds every 16-bit value exactly).
const DESCRIPTOR: usize = 3 + 2 * MAX_DIMS;

/// [`NcclHost::agree`] for host communicators without a cheaper way: every member
/// contributes a small descriptor of the call (a hash of `action`, and `shape`) to an
/// all-gather over `group`, and compares the others' with its own.
pub fn agree_by_all_gather<B: Backend, C: Communicator<B>>(
    comm: &C,
    group: Group,
    action: CommOp,
    shape: &[usize],
) -> Result<(), CommError> {
    let invalid = |reason: String| CommError::InvalidArgument {
        rank: comm.rank(),
        action,
        reason,
    };
    if shape.len() > MAX_DIMS || shape.iter().any(|&d| d >= 1 << 32) {
        return Err(invalid(format!(
            "shape {shape:?} is beyond what the call agreement describes ({MAX_DIMS} \
             dimensions below 2^32)"
        )));
    }
    let hash = fnv1a(action.to_string().as_bytes());
    let mut mine = vec![0u32; DESCRIPTOR];
    mine[0] = hash >> 16;
    mine[1] = hash & 0xffff;
    mine[2] = shape.len() as u32;
    for (i, &d) in shape.iter().enumerate() {
        mine[3 + 2 * i] = (d >> 16) as u32;
        mine[4 + 2 * i] = (d & 0xffff) as u32;
    }
    let gathered = comm.all_gather(group, to_tensor::<B>(&mine, comm.device()))?;
    let all =
        from_tensor(gathered).map_err(|e| invalid(format!("reading the call descriptors: {e}")))?;
    for (peer, theirs) in comm
        .group_members(group)
        .into_iter()
        .zip(all.chunks(DESCRIPTOR))
    {
        if theirs[..2] != mine[..2] {
            return Err(invalid(format!(
                "rank {peer} of the {group} issued another collective at this point"
            )));
        }
        if theirs != mine.as_slice() {
            let dims = (theirs[2] as usize).min(MAX_DIMS);
            let their_shape: Vec<usize> = (0..dims)
                .map(|i| ((theirs[3 + 2 * i] as usize) << 16) | theirs[4 + 2 * i] as usize)
                .collect();
            return Err(CommError::ShapeMismatch {
                rank: comm.rank(),
                peer,
                action,
                expected: shape.to_vec(),
                actual: their_shape,
            });
        }
    }
    Ok(())
}

/// 32-bit FNV-1a: a stable hash of the call's name (the same on every process).
fn fnv1a(bytes: &[u8]) -> u32 {
    bytes.iter().fold(0x811c_9dc5u32, |h, &b| {
        (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
    })
}

/// What the members of one group learn at start-up: each member's GPU, in group-rank order,
/// and, when those GPUs are distinct (the group can be an NCCL communicator), the unique id
/// that group rank 0 made.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GroupSetup {
    /// Each member's GPU ordinal, in group-rank order.
    pub ordinals: Vec<i32>,
    /// The NCCL unique id of the group's communicator; `None` when members share a GPU.
    pub unique_id: Option<[u8; NCCL_ID_BYTES]>,
}

/// Runs the start-up exchange of `group` over `comm`: gathers the members' GPU `ordinal`s
/// and, if they are distinct, has group rank 0 call `make_id` and gives every member its
/// bytes. Every member must call it, in the same order for its two groups.
pub fn setup_group<B: Backend, C: Communicator<B>>(
    comm: &C,
    group: Group,
    ordinal: i32,
    make_id: impl FnOnce() -> Result<[u8; NCCL_ID_BYTES], String>,
) -> Result<GroupSetup, CommError> {
    let action = CommOp::AllGather(group);
    let data_error = |reason: String| CommError::Data {
        rank: comm.rank(),
        action,
        reason,
    };
    let device = comm.device();
    let ordinals: Vec<i32> =
        from_tensor(comm.all_gather(group, to_tensor::<B>(&[ordinal as u32], device))?)
            .map_err(data_error)?
            .into_iter()
            .map(|v| v as i32)
            .collect();
    let positions: Vec<usize> = (0..ordinals.len()).collect();
    if first_shared_device(&positions, &ordinals).is_some() {
        return Ok(GroupSetup {
            ordinals,
            unique_id: None,
        });
    }
    let id = if comm.group_rank(group) == 0 {
        make_id().map_err(|reason| data_error(format!("creating the NCCL unique id: {reason}")))?
    } else {
        [0; NCCL_ID_BYTES]
    };
    let bytes: Vec<u32> = id.iter().map(|&b| u32::from(b)).collect();
    let shared = from_tensor(comm.broadcast(group, 0, to_tensor::<B>(&bytes, device))?)
        .map_err(data_error)?;
    let mut unique_id = [0u8; NCCL_ID_BYTES];
    for (byte, v) in unique_id.iter_mut().zip(shared) {
        *byte = v as u8;
    }
    Ok(GroupSetup {
        ordinals,
        unique_id: Some(unique_id),
    })
}

/// Small non-negative integers (below 2^24, exact in f32) as a tensor, for the host
/// communicator's collectives.
fn to_tensor<B: Backend>(values: &[u32], device: &B::Device) -> Tensor<B, 1> {
    let floats: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    Tensor::from_data(TensorData::new(floats, [values.len()]), device)
}

/// The integers of [`to_tensor`] back from a collective's result.
fn from_tensor<B: Backend>(tensor: Tensor<B, 1>) -> Result<Vec<u32>, String> {
    let values = read(tensor, ReadPurpose::Sync)
        .map_err(|e| format!("{e:?}"))?
        .to_vec::<f32>()
        .map_err(|e| format!("{e:?}"))?;
    Ok(values.iter().map(|&v| v as u32).collect())
}
