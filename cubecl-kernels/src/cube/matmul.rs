//! The matrix products inside the fused MLP and cross-entropy on CubeCL backends.
//!
//! f32 operands are multiplied in f32: Burn 0.21's matmul hands f32 to cubek's tensor-core
//! routines, which stage it as TF32 (10-bit mantissa) wherever the device has TF32 (CUDA), so
//! an f32 model trained with the fused ops would silently lose the precision its user chose,
//! and the ops would miss the 1e-4 agreement with a float64 reference that they keep on every
//! other backend. cubek's unit routine multiplies with ordinary f32 fused multiply-adds on any
//! device. f16 and bf16 keep Burn's matmul and its tensor cores: their inputs have no bits for
//! TF32 to drop, and they are the fast path.

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{launch_ref, Strategy};
use cubek::std::InputBinding;

use super::output;

/// `lhs · rhs` for `[m, k]` and `[k, n]` operands of one float type (any strides), as a
/// compact `[m, n]` tensor of that type.
pub(crate) fn matmul<B, R>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    if lhs.dtype != DType::F32 || rhs.dtype != DType::F32 {
        return B::float_matmul(lhs, rhs);
    }
    let m = lhs.shape().dims::<2>()[0];
    let n = rhs.shape().dims::<2>()[1];
    let out = output(&lhs, Shape::new([m, n]), DType::F32);
    let client = out.client.clone();
    let f32_type = DType::F32.into();
    let lhs = InputBinding::new(lhs.binding(), f32_type);
    let rhs = InputBinding::new(rhs.binding(), f32_type);
    let globals = MatmulGlobalElems {
        lhs: f32_type,
        rhs: f32_type,
        out: f32_type,
    };
    // The unit routine takes every shape and layout the fused ops pass; the naive one is
    // there in case a device refuses the unit routine's line sizes.
    let mut failures = Vec::new();
    for strategy in [Strategy::SimpleUnit(Default::default()), Strategy::Naive] {
        let mut dtypes = MatmulElems::from_globals(&globals);
        match launch_ref(
            &strategy,
            &client,
            lhs.clone(),
            rhs.clone(),
            out.clone().binding(),
            &mut dtypes,
        ) {
            Ok(()) => return out,
            Err(e) => failures.push(format!("{strategy}: {e:?}")),
        }
    }
    // Burn's own matmul panics the same way: a kernel launch has no error path to its caller.
    panic!(
        "no f32 matmul routine of cubek accepts [{m}, k] x [k, {n}]: {}",
        failures.join("; ")
    )
}
