//! The matrix products inside the fused MLP and cross-entropy on CubeCL backends.
//!
//! f32 operands are multiplied in f32: Burn 0.21's matmul hands f32 to cubek's tensor-core
//! routines, which stage it as TF32 (10-bit mantissa) wherever the device has TF32 (CUDA), so
//! an f32 model trained with the fused ops would silently lose the precision its user chose,
//! and the ops would miss the 1e-4 agreement with a float64 reference that they keep on every
//! other backend. cubek's unit routine multiplies with ordinary f32 fused multiply-adds on any
//! device. Where the device has no TF32 (Vulkan, Metal), Burn's matmul (autotuned with the
//! `autotune` feature) is already exact f32 and faster, so it stays ([`F32Matmul::Auto`]).
//! f16 and bf16 always keep Burn's matmul and its tensor cores: their inputs have no bits for
//! TF32 to drop, and they are the fast path.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};

use burn::tensor::backend::Backend;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeRuntime;
use cubecl::prelude::CubePrimitive;
use cubecl::tf32;
use cubek::matmul::definition::{MatmulElems, MatmulGlobalElems};
use cubek::matmul::launch::{launch_ref, Strategy};
use cubek::std::InputBinding;

use super::output;

/// How the fused MLP and cross-entropy multiply f32 operands on CubeCL backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum F32Matmul {
    /// In f32 everywhere: cubek's unit routine on devices where Burn's matmul would round f32
    /// to TF32 (CUDA), Burn's matmul elsewhere. The default.
    Auto,
    /// Always cubek's unit routine: the way to run it on devices without TF32 (the tests do).
    Unit,
    /// Always Burn's matmul: TF32 on CUDA (about 1e-3 relative error, tensor-core speed),
    /// for f32 models that prefer speed, as Burn's own `Linear` does there.
    Burn,
}

static F32_MATMUL: AtomicU8 = AtomicU8::new(0);
static UNIT_LAUNCHES: AtomicUsize = AtomicUsize::new(0);

/// Chooses how the fused ops multiply f32 for the whole process (default
/// [`F32Matmul::Auto`]).
pub fn set_f32_matmul(choice: F32Matmul) {
    let code = match choice {
        F32Matmul::Auto => 0,
        F32Matmul::Unit => 1,
        F32Matmul::Burn => 2,
    };
    F32_MATMUL.store(code, Ordering::SeqCst);
}

/// The current [`set_f32_matmul`] choice.
fn f32_matmul() -> F32Matmul {
    match F32_MATMUL.load(Ordering::SeqCst) {
        1 => F32Matmul::Unit,
        2 => F32Matmul::Burn,
        _ => F32Matmul::Auto,
    }
}

/// How many f32 products the fused ops have sent to cubek's unit routine in this process, so
/// tests can tell which routine they checked instead of assuming it.
pub fn unit_matmul_launches() -> usize {
    UNIT_LAUNCHES.load(Ordering::SeqCst)
}

/// Whether Burn's matmul rounds f32 operands to TF32 on `client`'s device: cubek's tensor-core
/// routines do exactly where the device supports the `tf32` type.
fn rounds_f32_to_tf32<R: CubeRuntime>(client: &cubecl::prelude::ComputeClient<R>) -> bool {
    client
        .properties()
        .supports_type(tf32::as_type_native_unchecked().storage_type())
}

/// `lhs · rhs` for `[m, k]` and `[k, n]` operands of one float type (any strides), as a
/// compact `[m, n]` tensor of that type.
pub(crate) fn matmul<B, R>(lhs: CubeTensor<R>, rhs: CubeTensor<R>) -> CubeTensor<R>
where
    R: CubeRuntime,
    B: Backend<FloatTensorPrimitive = CubeTensor<R>>,
{
    let unit = lhs.dtype == DType::F32
        && rhs.dtype == DType::F32
        && match f32_matmul() {
            F32Matmul::Auto => rounds_f32_to_tf32(&lhs.client),
            F32Matmul::Unit => true,
            F32Matmul::Burn => false,
        };
    if !unit {
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
            Ok(()) => {
                UNIT_LAUNCHES.fetch_add(1, Ordering::SeqCst);
                return out;
            }
            Err(e) => failures.push(format!("{strategy}: {e:?}")),
        }
    }
    // Burn's own matmul panics the same way: a kernel launch has no error path to its caller.
    panic!(
        "no f32 matmul routine of cubek accepts [{m}, k] x [k, {n}]: {}",
        failures.join("; ")
    )
}
