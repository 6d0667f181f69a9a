//! One rank's member of an NCCL communicator over one of its groups, and the collectives on
//! the device buffers of Burn CUDA tensors through it.
//!
//! Each member owns its communicator and a CUDA stream of its own. A collective takes the
//! input's device pointer from CubeCL's memory pool, waits for the rank's queued compute
//! (`Backend::sync`, since CubeCL does not expose its streams to order against), launches the
//! NCCL call on the member's stream and records an event after it: a [`Launched`] call. No
//! host copy. The caller keeps the call (its input and output stay allocated and unmoved) and
//! waits for its event before handing the output to later kernels, so they read finished
//! data; in between the rank's compute runs beside the transfer. The wait polls the event and
//! NCCL's asynchronous error state, and past the world's timeout aborts the communicator: a
//! peer that dies inside a collective ends this rank with an error instead of a hang.
//!
//! Calls of one member run in launch order on its stream, so waiting for a call also covers
//! the member's older ones. Every member of a group launches the group's calls in the same
//! order (as the engine issues every collective), which is the only ordering NCCL needs
//! within a communicator; across a rank's two communicators `NcclComm` waits for the other
//! one's calls before it launches on one, so no two communicators of a rank have calls in
//! flight at once.

use burn::backend::cuda::CudaDevice;
use burn::tensor::DType;
use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::client::ComputeClient;
use cubecl::cuda::CudaRuntime;
use cudarc::driver::{result as cu, sys as cusys};
use cudarc::nccl::{result as nccl, sys as nsys};
use std::ffi::c_void;
use std::fmt;

use super::watchdog::{CallState, WatchedCall};
use super::ReduceOp;

/// Why an NCCL call failed, before the caller adds its rank and action.
pub(crate) type NcclFailure = String;

/// One rank's member of an NCCL communicator; see the [module docs](self).
pub(crate) struct NcclMember {
    comm: nsys::ncclComm_t,
    stream: cusys::CUstream,
    context: cusys::CUcontext,
    ordinal: i32,
    group_rank: usize,
    group_size: usize,
    /// Set once the communicator was aborted; it cannot be used or destroyed after that.
    aborted: bool,
}

// SAFETY: the communicator, stream and context are plain handles; a member is used by one
// thread at a time (it moves into its rank's thread), which makes the context current before
// every call, as NCCL and CUDA require.
unsafe impl Send for NcclMember {}

impl fmt::Debug for NcclMember {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NcclMember")
            .field("gpu", &self.ordinal)
            .field("group_rank", &self.group_rank)
            .field("group_size", &self.group_size)
            .field("aborted", &self.aborted)
            .finish()
    }
}

/// NCCL calls launched on a member's stream (one collective, or one group of sends and
/// receives); see the [module docs](self). Dropping it before [`NcclMember::wait_for`]
/// returned releases buffers the calls may still use: the owner aborts the member first (see
/// `NcclComm`'s `Drop`).
pub(crate) struct Launched {
    /// The collective's output, or the receives' buffers in the order they were posted.
    outputs: Vec<CubeTensor<CudaRuntime>>,
    /// Kept until the calls finished, with every buffer's binding in CubeCL's memory pool
    /// (while held, an allocation stays where it is and goes to no other tensor; boxed
    /// because CubeCL does not export the binding's type).
    _inputs: Vec<CubeTensor<CudaRuntime>>,
    _buffers: Vec<Box<dyn std::any::Any + Send>>,
    /// Recorded on the member's stream right after the calls.
    done: cusys::CUevent,
}

// SAFETY: the event is a plain handle; a call moves with its rank's communicator into the
// rank's thread and is only used there.
unsafe impl Send for Launched {}

impl Launched {
    /// The calls' outputs; only to be used once [`NcclMember::wait_for`] returned for them.
    pub(crate) fn into_outputs(self) -> Vec<CubeTensor<CudaRuntime>> {
        self.outputs.clone()
    }

    /// Whether the calls have finished (a poll of their event; an error counts as finished,
    /// and the next wait on the member reports it).
    pub(crate) fn finished(&self) -> bool {
        // SAFETY: the event was created for these calls and lives as long as they do.
        let state = unsafe { cusys::cuEventQuery(self.done) };
        state != cusys::CUresult::CUDA_ERROR_NOT_READY
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        // SAFETY: the event was created for this call and is destroyed once; CUDA releases an
        // event that is still pending when it completes.
        let _ = unsafe { cu::event::destroy(self.done) };
    }
}

impl fmt::Debug for Launched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let shapes: Vec<_> = self.outputs.iter().map(|t| t.meta.shape()).collect();
        f.debug_struct("Launched")
            .field("output_shapes", &shapes)
            .finish()
    }
}

/// What one NCCL call is given: device buffers, element counts and type, communicator and
/// stream.
struct Call {
    send: *const c_void,
    recv: *mut c_void,
    input_len: usize,
    output_len: usize,
    ty: nsys::ncclDataType_t,
    comm: nsys::ncclComm_t,
    stream: nsys::cudaStream_t,
}

impl NcclMember {
    /// The members of one group whose ranks are threads of this process, one per GPU in
    /// `ordinals` (group-rank order), created together by `ncclCommInitAll`. NCCL refuses
    /// two members on one GPU; callers check that first.
    pub(crate) fn init_all(ordinals: &[i32]) -> Result<Vec<NcclMember>, NcclFailure> {
        let n = ordinals.len();
        let mut comms: Vec<nsys::ncclComm_t> = vec![std::ptr::null_mut(); n];
        // SAFETY: `comms` has room for one communicator per device in `ordinals`.
        unsafe { nccl::comm_init_all(comms.as_mut_ptr(), n as i32, ordinals.as_ptr()) }
            .map_err(|e| format!("ncclCommInitAll on GPUs {ordinals:?}: {e:?}"))?;
        let mut members = Vec::with_capacity(n);
        for (group_rank, (&comm, &ordinal)) in comms.iter().zip(ordinals).enumerate() {
            match Self::with_stream(comm, ordinal, group_rank, n) {
                Ok(member) => members.push(member),
                Err(e) => {
                    // SAFETY: the communicators not yet owned by a member were created above
                    // and are destroyed once.
                    for &rest in &comms[group_rank..] {
                        let _ = unsafe { nccl::comm_destroy(rest) };
                    }
                    return Err(e);
                }
            }
        }
        Ok(members)
    }

    /// This process's member of a group whose other members are other processes: group
    /// rank `group_rank` of `group_size`, on GPU `ordinal`, joining the communicator that
    /// group rank 0 named by `unique_id`. Blocks until every member has called it.
    pub(crate) fn init_rank(
        unique_id: [u8; 128],
        group_size: usize,
        group_rank: usize,
        ordinal: i32,
    ) -> Result<NcclMember, NcclFailure> {
        let cuda = |what: &str, e: cudarc::driver::DriverError| format!("{what}: {e:?}");
        let id = nsys::ncclUniqueId {
            internal: unique_id.map(|b| b as std::ffi::c_char),
        };
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: NCCL creates the communicator on the current device, so this GPU's primary
        // context is made current first (and released again: the member retains its own).
        unsafe {
            cu::init().map_err(|e| cuda("cuInit", e))?;
            let device = cu::device::get(ordinal).map_err(|e| cuda("cuDeviceGet", e))?;
            let context =
                cu::primary_ctx::retain(device).map_err(|e| cuda("cuDevicePrimaryCtxRetain", e))?;
            let current = cu::ctx::set_current(context).map_err(|e| cuda("cuCtxSetCurrent", e));
            let made = current.and_then(|()| {
                nccl::comm_init_rank(&mut comm, group_size as i32, id, group_rank as i32)
                    .map(|_| ())
                    .map_err(|e| {
                        format!("ncclCommInitRank (rank {group_rank} of {group_size}): {e:?}")
                    })
            });
            let _ = cu::primary_ctx::release(device);
            made?;
        }
        Self::with_stream(comm, ordinal, group_rank, group_size).inspect_err(|_| {
            // SAFETY: the communicator was created above and is not owned by a member.
            let _ = unsafe { nccl::comm_destroy(comm) };
        })
    }

    fn with_stream(
        comm: nsys::ncclComm_t,
        ordinal: i32,
        group_rank: usize,
        group_size: usize,
    ) -> Result<NcclMember, NcclFailure> {
        let cuda = |what: &str, e: cudarc::driver::DriverError| format!("{what}: {e:?}");
        // SAFETY: the device ordinal names a device NCCL just opened; the primary context is
        // retained for the member's lifetime and released in `Drop`.
        unsafe {
            cu::init().map_err(|e| cuda("cuInit", e))?;
            let device = cu::device::get(ordinal).map_err(|e| cuda("cuDeviceGet", e))?;
            let context =
                cu::primary_ctx::retain(device).map_err(|e| cuda("cuDevicePrimaryCtxRetain", e))?;
            cu::ctx::set_current(context).map_err(|e| cuda("cuCtxSetCurrent", e))?;
            let stream = cu::stream::create(cu::stream::StreamKind::NonBlocking)
                .map_err(|e| cuda("cuStreamCreate", e))?;
            Ok(NcclMember {
                comm,
                stream,
                context,
                ordinal,
                group_rank,
                group_size,
                aborted: false,
            })
        }
    }

    /// Sum or mean over the group, elementwise.
    pub(crate) fn all_reduce(
        &mut self,
        input: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<Launched, NcclFailure> {
        self.collective(
            input,
            |n| n,
            |c| {
                // SAFETY: both buffers hold `input_len` elements of `ty` on this member's GPU.
                unsafe {
                    nccl::all_reduce(
                        c.send,
                        c.recv,
                        c.input_len,
                        c.ty,
                        reduce_op(op),
                        c.comm,
                        c.stream,
                    )
                }
            },
        )
    }

    /// The members' shards of `shard.len()` elements each, concatenated in group-rank order.
    pub(crate) fn all_gather(
        &mut self,
        shard: CubeTensor<CudaRuntime>,
    ) -> Result<Launched, NcclFailure> {
        let size = self.group_size;
        self.collective(
            shard,
            |n| n * size,
            |c| {
                // SAFETY: `send` holds `input_len` elements and `recv` `input_len × size`.
                unsafe { nccl::all_gather(c.send, c.recv, c.input_len, c.ty, c.comm, c.stream) }
            },
        )
    }

    /// This member's chunk (group-rank order) of the group's reduction of `tensor`, whose
    /// length the caller checked to be divisible by the group size.
    pub(crate) fn reduce_scatter(
        &mut self,
        tensor: CubeTensor<CudaRuntime>,
        op: ReduceOp,
    ) -> Result<Launched, NcclFailure> {
        let size = self.group_size;
        self.collective(
            tensor,
            |n| n / size,
            |c| {
                // SAFETY: `send` holds `output_len × size` elements and `recv` `output_len`.
                unsafe {
                    let op = reduce_op(op);
                    nccl::reduce_scatter(c.send, c.recv, c.output_len, c.ty, op, c.comm, c.stream)
                }
            },
        )
    }

    /// The tensor of group rank `root`, on every member.
    pub(crate) fn broadcast(
        &mut self,
        tensor: CubeTensor<CudaRuntime>,
        root: usize,
    ) -> Result<Launched, NcclFailure> {
        self.collective(
            tensor,
            |n| n,
            |c| {
                // SAFETY: both buffers hold `input_len` elements of `ty`.
                unsafe {
                    nccl::broadcast(
                        c.send,
                        c.recv,
                        c.input_len,
                        c.ty,
                        root as i32,
                        c.comm,
                        c.stream,
                    )
                }
            },
        )
    }

    /// Launches one NCCL call from `tensor` (made contiguous) into a fresh output whose first
    /// dimension is `first_dim` of the input's (other dimensions kept), on this member's
    /// stream; see the module docs for the ordering.
    fn collective(
        &mut self,
        tensor: CubeTensor<CudaRuntime>,
        first_dim: impl Fn(usize) -> usize,
        call: impl FnOnce(&Call) -> Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<Launched, NcclFailure> {
        if self.aborted {
            return Err("the NCCL communicator was aborted by an earlier failure".into());
        }
        let input = into_contiguous(tensor);
        let mut dims: Vec<usize> = input.meta.shape().iter().copied().collect();
        if let Some(first) = dims.first_mut() {
            *first = first_dim(*first);
        }
        // Compact, not Burn's default allocation: on CUDA that pads rows to 256 bytes, and
        // NCCL writes `output_len` elements back to back.
        let output = empty_device_contiguous_dtype(
            input.client.clone(),
            input.device.clone(),
            Shape::from(dims),
            input.dtype,
        );
        let resource = |t: &CubeTensor<CudaRuntime>| {
            t.client
                .get_resource(t.handle.clone())
                .map_err(|e| format!("device buffer of the tensor: {e:?}"))
        };
        let send = resource(&input)?;
        let recv = resource(&output)?;
        wait_for_producers(&input)?;
        let args = Call {
            send: send.resource().ptr as *const c_void,
            recv: recv.resource().ptr as *mut c_void,
            input_len: input.meta.shape().num_elements(),
            output_len: output.meta.shape().num_elements(),
            ty: nccl_type(input.dtype)?,
            comm: self.comm,
            stream: self.stream as nsys::cudaStream_t,
        };
        // SAFETY: the context was retained at creation; the pointers are live device buffers
        // of this GPU (held by the returned call), the stream and communicator belong to this
        // member.
        unsafe { cu::ctx::set_current(self.context) }
            .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let done = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("cuEventCreate: {e:?}"))?;
        let launched = Launched {
            outputs: vec![output],
            _inputs: vec![input],
            _buffers: vec![Box::new(send), Box::new(recv)],
            done,
        };
        call(&args).map_err(|e| format!("launch: {e:?}"))?;
        // SAFETY: the event was created above, the stream is this member's.
        unsafe { cu::event::record(done, self.stream) }
            .map_err(|e| self.abort(format!("cuEventRecord after the call: {e:?}")))?;
        Ok(launched)
    }

    /// `call` (launched by this member) as the watchdog polls it (see [`super::watchdog`]):
    /// its event and the communicator's asynchronous error state; aborting it aborts the
    /// communicator, which also ends the kernel waiting for a peer, so a rank never hangs in
    /// NCCL. Fails when the communicator was aborted before.
    pub(crate) fn watched<'a>(
        &'a mut self,
        call: &'a Launched,
    ) -> Result<impl WatchedCall + 'a, NcclFailure> {
        if self.aborted {
            return Err("the NCCL communicator was aborted by an earlier failure".into());
        }
        Ok(Watched { member: self, call })
    }

    /// Sends each of `sends` (`(tensor, group rank)`) and receives each of `recvs` (`(shape,
    /// dtype, group rank)`) into fresh buffers on `device`, as one NCCL group (so that no
    /// order of the peers' own groups can deadlock), on this member's stream; the receives'
    /// buffers are the call's outputs, in order.
    pub(crate) fn p2p(
        &mut self,
        sends: Vec<(CubeTensor<CudaRuntime>, usize)>,
        recvs: &[(Shape, DType, usize)],
        client: &ComputeClient<CudaRuntime>,
        device: &CudaDevice,
    ) -> Result<Launched, NcclFailure> {
        if self.aborted {
            return Err("the NCCL communicator was aborted by an earlier failure".into());
        }
        let resource = |t: &CubeTensor<CudaRuntime>| {
            t.client
                .get_resource(t.handle.clone())
                .map_err(|e| format!("device buffer of the tensor: {e:?}"))
        };
        let inputs: Vec<_> = sends
            .into_iter()
            .map(|(t, peer)| (into_contiguous(t), peer))
            .collect();
        let outputs: Vec<_> = recvs
            .iter()
            .map(|(shape, dtype, _)| {
                empty_device_contiguous_dtype(client.clone(), device.clone(), shape.clone(), *dtype)
            })
            .collect();
        let mut buffers: Vec<Box<dyn std::any::Any + Send>> = Vec::new();
        let mut posts = Vec::new();
        for (t, peer) in &inputs {
            let r = resource(t)?;
            let ptr = r.resource().ptr as *mut c_void;
            posts.push((
                true,
                ptr,
                t.meta.shape().num_elements(),
                nccl_type(t.dtype)?,
                *peer,
            ));
            buffers.push(Box::new(r));
        }
        for (t, (_, _, peer)) in outputs.iter().zip(recvs) {
            let r = resource(t)?;
            let ptr = r.resource().ptr as *mut c_void;
            posts.push((
                false,
                ptr,
                t.meta.shape().num_elements(),
                nccl_type(t.dtype)?,
                *peer,
            ));
            buffers.push(Box::new(r));
        }
        if let Some((t, _)) = inputs.first() {
            wait_for_producers(t)?;
        }
        // SAFETY: the context was retained at creation.
        unsafe { cu::ctx::set_current(self.context) }
            .map_err(|e| format!("cuCtxSetCurrent: {e:?}"))?;
        let done = cu::event::create(cusys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("cuEventCreate: {e:?}"))?;
        let launched = Launched {
            outputs,
            _inputs: inputs.into_iter().map(|(t, _)| t).collect(),
            _buffers: buffers,
            done,
        };
        let stream = self.stream as nsys::cudaStream_t;
        nccl::group_start().map_err(|e| format!("ncclGroupStart: {e:?}"))?;
        let mut posted = Ok(());
        for &(is_send, ptr, count, ty, peer) in &posts {
            // SAFETY: every pointer is a live device buffer of this GPU of `count` elements
            // of `ty`, held by `launched` until the calls finished; the stream and the
            // communicator are this member's.
            let result = unsafe {
                if is_send {
                    nccl::send(ptr, count, ty, peer as i32, self.comm, stream)
                } else {
                    nccl::recv(ptr, count, ty, peer as i32, self.comm, stream)
                }
            };
            if let Err(e) = result {
                posted = Err(format!("posting a transfer with group rank {peer}: {e:?}"));
                break;
            }
        }
        // The group is closed whatever happened inside it (NCCL requires the pairing).
        let ended = nccl::group_end().map_err(|e| format!("ncclGroupEnd: {e:?}"));
        if let Err(e) = posted.and(ended) {
            return Err(self.abort(e));
        }
        // SAFETY: the event was created above, the stream is this member's.
        unsafe { cu::event::record(done, self.stream) }
            .map_err(|e| self.abort(format!("cuEventRecord after the transfers: {e:?}")))?;
        Ok(launched)
    }

    /// Aborts the communicator, if it is not aborted yet, when calls launched on it are about
    /// to be dropped unfinished: the abort ends them, so their buffers can be released.
    pub(crate) fn abort_unfinished(&mut self) {
        if !self.aborted {
            let _ = self.abort("calls still in flight when the communicator went away".into());
        }
    }

    /// Aborts the communicator (NCCL's way out of a call a peer never joins) and returns
    /// `reason` with what happened.
    fn abort(&mut self, reason: String) -> NcclFailure {
        self.aborted = true;
        // SAFETY: the communicator is this member's and is not used after this.
        match unsafe { nccl::comm_abort(self.comm) } {
            Ok(_) => format!("{reason}; communicator aborted"),
            Err(e) => format!("{reason}; aborting the communicator failed too: {e:?}"),
        }
    }
}

impl Drop for NcclMember {
    fn drop(&mut self) {
        // SAFETY: the handles are this member's and are released once; an aborted
        // communicator is already freed by the abort.
        unsafe {
            let _ = cu::ctx::set_current(self.context);
            if !self.aborted {
                let _ = nccl::comm_destroy(self.comm);
            }
            let _ = cu::stream::destroy(self.stream);
            if let Ok(device) = cu::device::get(self.ordinal) {
                let _ = cu::primary_ctx::release(device);
            }
        }
    }
}

/// A launched call of a member, as the watchdog polls it: its event, and NCCL's
/// asynchronous error state of the member's communicator.
struct Watched<'a> {
    member: &'a mut NcclMember,
    call: &'a Launched,
}

impl WatchedCall for Watched<'_> {
    fn state(&mut self) -> CallState {
        // SAFETY: the event is the call's, the communicator this member's, with its context
        // current.
        let done = unsafe {
            let _ = cu::ctx::set_current(self.member.context);
            cusys::cuEventQuery(self.call.done)
        };
        match done {
            cusys::CUresult::CUDA_SUCCESS => return CallState::Done,
            cusys::CUresult::CUDA_ERROR_NOT_READY => {}
            other => return CallState::Failed(format!("CUDA error {other:?}")),
        }
        let mut state = nsys::ncclResult_t::ncclSuccess;
        // SAFETY: as above.
        let asked = unsafe { nsys::ncclCommGetAsyncError(self.member.comm, &mut state) };
        if asked != nsys::ncclResult_t::ncclSuccess {
            return CallState::Failed(format!("ncclCommGetAsyncError: {asked:?}"));
        }
        match state {
            nsys::ncclResult_t::ncclSuccess | nsys::ncclResult_t::ncclInProgress => {
                CallState::Running
            }
            other => CallState::Failed(format!("NCCL reported {other:?}")),
        }
    }

    fn abort(&mut self, reason: String) -> String {
        self.member.abort(reason)
    }
}

/// Waits until the compute queued on `tensor`'s device by this thread has finished, so the
/// input buffer holds its final values when NCCL reads it.
fn wait_for_producers(tensor: &CubeTensor<CudaRuntime>) -> Result<(), NcclFailure> {
    cubecl::future::block_on(tensor.client.sync())
        .map_err(|e| format!("waiting for the input's producers: {e:?}"))
}

/// NCCL's element type for a Burn float type.
fn nccl_type(dtype: DType) -> Result<nsys::ncclDataType_t, NcclFailure> {
    Ok(match dtype {
        DType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DType::BF16 => nsys::ncclDataType_t::ncclBfloat16,
        DType::F64 => nsys::ncclDataType_t::ncclFloat64,
        other => return Err(format!("no NCCL element type for {other:?}")),
    })
}

/// NCCL's reduction for ours: `Mean` is NCCL's `ncclAvg` (sum, then divide by the group
/// size).
fn reduce_op(op: ReduceOp) -> nsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nsys::ncclRedOp_t::ncclSum,
        ReduceOp::Mean => nsys::ncclRedOp_t::ncclAvg,
    }
}

/// A fresh NCCL unique id (what group rank 0 creates and the other members join with).
pub(crate) fn nccl_unique_id() -> Result<[u8; 128], NcclFailure> {
    let id = nccl::get_uniqueid().map_err(|e| format!("ncclGetUniqueId: {e:?}"))?;
    Ok(id.internal.map(|c| c as u8))
}
