//! Moving modules and tensors between devices through host memory.
//!
//! Burn 0.21's CubeCL backends implement `Tensor::to_device` between two devices as a
//! server-to-server transfer that only the CUDA runtime provides (NCCL); wgpu panics with
//! "not implemented". The engine moves a rank's stages once and its micro-batches once per
//! step, both small next to the step's work, so it takes the portable route: read to the host,
//! create on the target device with the same dtype. Where source and target are the same
//! device nothing is copied.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{BasicOps, Bool, Int, Tensor, TensorCreationOptions};

use crate::host_read::{read, ReadPurpose};

/// `tensor` on `device` with its dtype (and, for a float tensor, without autodiff history).
pub fn tensor_to_device<B, const D: usize, K>(
    tensor: Tensor<B, D, K>,
    device: &B::Device,
) -> Tensor<B, D, K>
where
    B: Backend,
    K: BasicOps<B>,
{
    if tensor.device() == *device {
        return tensor;
    }
    let dtype = tensor.dtype();
    // A device that cannot be read has failed; there is no other way to move the tensor.
    let data = read(tensor, ReadPurpose::Transfer).expect("the source device is readable");
    Tensor::from_data(
        data,
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

/// `module` with every parameter on `device`: parameter ids kept, float parameters that
/// required gradients still do (as leaves of a new graph, like `Module::fork`).
pub fn module_to_device<B: Backend, M: Module<B>>(module: M, device: &B::Device) -> M {
    if module.devices().iter().all(|d| d == device) {
        return module;
    }
    struct Move<'a, B: Backend>(&'a B::Device);
    impl<B: Backend> ModuleMapper<B> for Move<'_, B> {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            param.map(|t| {
                let require_grad = t.is_require_grad();
                let moved = tensor_to_device(t.detach(), self.0);
                if require_grad {
                    moved.require_grad()
                } else {
                    moved
                }
            })
        }
        fn map_int<const D: usize>(
            &mut self,
            param: Param<Tensor<B, D, Int>>,
        ) -> Param<Tensor<B, D, Int>> {
            param.map(|t| tensor_to_device(t, self.0))
        }
        fn map_bool<const D: usize>(
            &mut self,
            param: Param<Tensor<B, D, Bool>>,
        ) -> Param<Tensor<B, D, Bool>> {
            param.map(|t| tensor_to_device(t, self.0))
        }
    }
    module.map(&mut Move(device))
}
