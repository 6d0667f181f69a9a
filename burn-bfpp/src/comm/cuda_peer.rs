//! Moving a Burn CUDA tensor to another GPU of this process with a peer copy (`cuMemcpyPeer`),
//! for point-to-point transfers between ranks that are threads on different GPUs.
//!
//! The receiver performs the copy when it receives, from the tensor the sender handed over,
//! so a transfer never waits for the sender to take part: no rendezvous, hence none of the
//! deadlocks an NCCL send/recv pair can run into (see `docs/multi-node.md`). Burn's own
//! `Tensor::to_device` between CUDA devices is not used for this: CubeCL 0.10 runs it as a
//! blocking NCCL send on the source GPU's server and a blocking receive on the destination's,
//! queued behind whatever those servers already hold, so two ranks pulling from each other at
//! once can each wait behind the other's receive.

use burn::backend::cuda::CudaDevice;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;
use cubecl::Runtime;
use cudarc::driver::{result as cu, sys as cusys};

/// `tensor` (on another GPU) copied to `device`; waits until the copy is done.
pub(crate) fn move_to_device(
    tensor: CubeTensor<CudaRuntime>,
    device: &CudaDevice,
) -> Result<CubeTensor<CudaRuntime>, String> {
    let src = into_contiguous(tensor);
    let bytes = src.meta.shape().num_elements() * src.dtype.size();
    // Compact like the source (Burn's default allocation pads rows on CUDA): the copy is
    // `bytes` back to back.
    let out = empty_device_contiguous_dtype(
        CudaRuntime::client(device),
        device.clone(),
        src.meta.shape().clone(),
        src.dtype,
    );
    let resource = |t: &CubeTensor<CudaRuntime>| {
        t.client
            .get_resource(t.handle.clone())
            .map_err(|e| format!("device buffer on GPU {}: {e:?}", t.device.index))
    };
    // Held until the copy is done: they keep both allocations alive.
    let from = resource(&src)?;
    let to = resource(&out)?;
    // The source's producers are done (the sender synchronised before handing it over), but
    // the fresh output buffer may be memory that work still queued on this GPU used last:
    // wait for that work before overwriting it outside CubeCL's stream order.
    for t in [&src, &out] {
        cubecl::future::block_on(t.client.sync())
            .map_err(|e| format!("waiting for GPU {}: {e:?}", t.device.index))?;
    }
    let context = |ordinal: usize| -> Result<cusys::CUcontext, String> {
        // SAFETY: retaining the primary context of an existing device; released below.
        unsafe {
            let dev = cu::device::get(ordinal as i32).map_err(|e| format!("{e:?}"))?;
            cu::primary_ctx::retain(dev).map_err(|e| format!("{e:?}"))
        }
    };
    let (src_ctx, dst_ctx) = (context(src.device.index)?, context(device.index)?);
    // SAFETY: both pointers are live device buffers of at least `bytes` bytes (held above) in
    // the primary contexts passed with them; cuMemcpyPeer returns once the copy is complete
    // for the host's purposes (it is synchronous with respect to the host).
    let copied = unsafe {
        let _ = cu::ctx::set_current(dst_ctx);
        cusys::cuMemcpyPeer(
            to.resource().ptr,
            dst_ctx,
            from.resource().ptr,
            src_ctx,
            bytes,
        )
    };
    // SAFETY: releases the references retained above.
    unsafe {
        for ordinal in [src.device.index, device.index] {
            if let Ok(dev) = cu::device::get(ordinal as i32) {
                let _ = cu::primary_ctx::release(dev);
            }
        }
    }
    if copied != cusys::CUresult::CUDA_SUCCESS {
        return Err(format!(
            "cuMemcpyPeer of {bytes} bytes from GPU {} to GPU {}: {copied:?}",
            src.device.index, device.index
        ));
    }
    Ok(out)
}
