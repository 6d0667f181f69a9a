//! Shared test harness: fresh random inputs, the float64 host oracle and generic checks that
//! run any `FusedOps` backend (forward through `B`, gradients through `Autodiff<B>`).
#![allow(dead_code)]

pub mod host;

use std::time::{SystemTime, UNIX_EPOCH};

use burn::backend::Autodiff;
use burn::tensor::{Bool, DType, Int, Tensor, TensorCreationOptions, TensorData};
use cubecl_kernels::FusedOps;

/// splitmix64: tiny, good enough for test inputs, and seeded from the clock so every run
/// draws fresh inputs; the seed is printed so a failure can be replayed with `SEED=...`.
pub struct Rng(u64);

impl Rng {
    pub fn fresh(test: &str) -> Self {
        let seed = std::env::var("SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| {
                SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_nanos() as u64)
                    .unwrap_or(1)
            });
        eprintln!("{test}: SEED={seed}");
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn uniform(&mut self) -> f32 {
        ((self.next_u64() >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
}

/// Fails unless `got` matches `want` to `tol` relative to the reference's largest magnitude
/// (`max |got − want| / max(max |want|, 1e-2)`), and fails on any NaN (unwritten poisoned
/// outputs). The floor keeps an exactly-zero reference (dQ with a single key, where
/// `dP − D` cancels exactly) from turning f32 rounding noise into a huge relative error: the
/// kernels' f32 dot products of the tests' O(1) inputs carry up to ~3e-7 absolute noise
/// (1.6e-7 was seen at head dim 16), which a 1e-3 floor let through as 1.6e-4 > 1e-4; with
/// 1e-2 it is an absolute 1e-6 bound, still far below any real error.
pub fn assert_close(what: &str, got: &[f32], want: &[f64], tol: f64) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let scale = want.iter().fold(0.0f64, |a, w| a.max(w.abs())).max(1e-2);
    let mut worst = (0.0f64, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(g.is_finite(), "{what}: element {i} is {g} (want {w})");
        let e = (*g as f64 - w).abs() / scale;
        if e > worst.0 {
            worst = (e, i);
        }
    }
    let i = worst.1;
    assert!(
        worst.0 <= tol,
        "{what}: relative error {:.3e} > {tol:.0e} at element {i} (got {}, want {})",
        worst.0,
        got[i],
        want[i]
    );
}

pub fn to_vec<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data()
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 readback")
}

/// Random attention case: shapes as given, mask with ~20% padded keys when `masked`.
pub fn attn_case(rng: &mut Rng, shape: [usize; 5], causal: bool, masked: bool) -> host::AttnCase {
    let [b, h, sq, sk, d] = shape;
    let mask = masked.then(|| (0..b * sk).map(|_| rng.below(5) == 0).collect());
    host::AttnCase {
        b,
        h,
        sq,
        sk,
        d,
        causal,
        mask,
        key_ramp: 0.0,
    }
}

/// Runs attention forward and backward on `B` (through `Autodiff<B>`) with fresh inputs and
/// checks output, log-sum-exp and all three gradients against the float64 oracle.
pub fn check_attention<B: FusedOps>(
    device: &B::Device,
    rng: &mut Rng,
    c: &host::AttnCase,
    tol: f64,
) {
    check_attention_dtype::<B>(device, rng, c, DType::F32, tol);
}

/// [`check_attention`] with inputs, output gradient and results in float type `dtype` (the
/// log-sum-exp stays f32).
pub fn check_attention_dtype<B: FusedOps>(
    device: &B::Device,
    rng: &mut Rng,
    c: &host::AttnCase,
    dtype: DType,
    tol: f64,
) {
    let (qn, kn) = (c.b * c.h * c.sq * c.d, c.b * c.h * c.sk * c.d);
    let (q, mut k, v, g) = (
        rounded(rng, qn, 1.5, dtype),
        rounded(rng, kn, 1.5, dtype),
        rounded(rng, kn, 1.0, dtype),
        rounded(rng, qn, 1.0, dtype),
    );
    if c.key_ramp != 0.0 {
        for (i, x) in k.iter_mut().enumerate() {
            let j = (i / c.d) % c.sk;
            *x *= 1.0 + c.key_ramp * j as f32 / c.sk as f32;
        }
        k = round_to(k, dtype);
    }
    let want = host::attention(c, &q, &k, &v, &g);
    let label = format!(
        "attention {dtype:?} b{} h{} sq{} sk{} d{} causal={} mask={} key_ramp={}",
        c.b,
        c.h,
        c.sq,
        c.sk,
        c.d,
        c.causal,
        c.mask.is_some(),
        c.key_ramp
    );

    type A<B> = Autodiff<B>;
    let t4 =
        |x: &[f32], s: usize| tensor_as::<A<B>, 4>(x.to_vec(), [c.b, c.h, s, c.d], dtype, device);
    let (qt, kt, vt) = (
        t4(&q, c.sq).require_grad(),
        t4(&k, c.sk).require_grad(),
        t4(&v, c.sk).require_grad(),
    );
    let mask = c.mask.as_ref().map(|m| {
        Tensor::<A<B>, 2, Bool>::from_data(TensorData::new(m.clone(), [c.b, c.sk]), device)
    });
    let (out, lse) =
        cubecl_kernels::flash_attention(qt.clone(), kt.clone(), vt.clone(), mask, c.causal)
            .expect("valid shapes");
    assert_eq!(out.dtype(), dtype, "{label}: output dtype");
    // The forward's outputs are checked before the backward runs and again after it, so a
    // failure says which pass left them wrong (the backward reads both, and must not write
    // over them).
    assert_close(
        &format!("{label}: out"),
        &to_vec(out.clone()),
        &want.out,
        tol,
    );
    assert_close(
        &format!("{label}: lse"),
        &to_vec(lse.clone()),
        &want.lse,
        tol,
    );
    let grads = (out.clone() * t4(&g, c.sq)).sum().backward();
    assert_close(
        &format!("{label}: out after the backward"),
        &to_vec(out),
        &want.out,
        tol,
    );
    assert_close(
        &format!("{label}: lse after the backward"),
        &to_vec(lse),
        &want.lse,
        tol,
    );
    assert_close(
        &format!("{label}: dq"),
        &to_vec(qt.grad(&grads).expect("dq")),
        &want.dq,
        tol,
    );
    assert_close(
        &format!("{label}: dk"),
        &to_vec(kt.grad(&grads).expect("dk")),
        &want.dk,
        tol,
    );
    assert_close(
        &format!("{label}: dv"),
        &to_vec(vt.grad(&grads).expect("dv")),
        &want.dv,
        tol,
    );
}

/// `gelu(x·W + b)` forward and `(dx, dW, db)` through `Autodiff<B>` against the oracle, f32.
pub fn check_linear_gelu<B: FusedOps>(
    device: &B::Device,
    rng: &mut Rng,
    shape: [usize; 3],
    tol: f64,
) {
    check_linear_gelu_dtype::<B>(device, rng, shape, DType::F32, tol);
}

/// Fresh random values rounded to `dtype` on the host (kept as f32), so the oracle sees
/// exactly the inputs the device computes with and the comparison measures the op alone.
pub fn rounded(rng: &mut Rng, len: usize, scale: f32, dtype: DType) -> Vec<f32> {
    round_to(rng.vec(len, scale), dtype)
}

/// `values` rounded to the nearest value of `dtype` (kept as f32).
pub fn round_to(values: Vec<f32>, dtype: DType) -> Vec<f32> {
    let len = values.len();
    TensorData::new(values, [len])
        .convert_dtype(dtype)
        .convert::<f32>()
        .to_vec::<f32>()
        .expect("f32 values")
}

/// `B` tensor of float type `dtype` from f32 values (converted on the host, no kernel).
pub fn tensor_as<B: burn::tensor::backend::Backend, const D: usize>(
    values: Vec<f32>,
    shape: [usize; D],
    dtype: DType,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::from_data(
        TensorData::new(values, shape),
        TensorCreationOptions::new(device.clone()).with_dtype(dtype),
    )
}

/// [`check_linear_gelu`] with inputs, output gradient and results in float type `dtype`.
pub fn check_linear_gelu_dtype<B: FusedOps>(
    device: &B::Device,
    rng: &mut Rng,
    [n, din, dout]: [usize; 3],
    dtype: DType,
    tol: f64,
) {
    let x = rounded(rng, n * din, 1.0, dtype);
    let w = rounded(rng, din * dout, 0.5, dtype);
    let b = rounded(rng, dout, 0.5, dtype);
    let dy = rounded(rng, n * dout, 1.0, dtype);
    let (y, dx, dw, db) = host::linear_gelu(&x, &w, &b, &dy, n, din, dout);
    let label = format!("linear_gelu {dtype:?} n{n} din{din} dout{dout}");
    type A<B> = Autodiff<B>;
    let xt = tensor_as::<A<B>, 2>(x, [n, din], dtype, device).require_grad();
    let wt = tensor_as::<A<B>, 2>(w, [din, dout], dtype, device).require_grad();
    let bt = tensor_as::<A<B>, 1>(b, [dout], dtype, device).require_grad();
    let out =
        cubecl_kernels::linear_gelu(xt.clone(), wt.clone(), bt.clone()).expect("valid inputs");
    assert_eq!(out.dtype(), dtype, "{label}: output dtype");
    let dyt = tensor_as::<A<B>, 2>(dy, [n, dout], dtype, device);
    let grads = (out.clone() * dyt).sum().backward();
    assert_close(&format!("{label}: y"), &to_vec(out), &y, tol);
    let (gx, gw, gb) = (
        xt.grad(&grads).expect("dx"),
        wt.grad(&grads).expect("dw"),
        bt.grad(&grads).expect("db"),
    );
    for (what, dt) in [("dx", gx.dtype()), ("dw", gw.dtype()), ("db", gb.dtype())] {
        assert_eq!(dt, dtype, "{label}: {what} dtype");
    }
    assert_close(&format!("{label}: dx"), &to_vec(gx), &dx, tol);
    assert_close(&format!("{label}: dw"), &to_vec(gw), &dw, tol);
    assert_close(&format!("{label}: db"), &to_vec(gb), &db, tol);
}

/// Asserts that `linear_gelu` refuses inputs of `dtype` with the unsupported-dtype error (and
/// a message that says so) instead of launching a kernel the device cannot run.
pub fn check_linear_gelu_refuses<B: FusedOps>(device: &B::Device, dtype: DType) {
    let x = tensor_as::<B, 2>(vec![0.5; 6], [2, 3], dtype, device);
    let w = tensor_as::<B, 2>(vec![0.25; 12], [3, 4], dtype, device);
    let b = tensor_as::<B, 1>(vec![0.0; 4], [4], dtype, device);
    assert_refused(
        "linear_gelu",
        dtype,
        cubecl_kernels::linear_gelu(x, w, b).err(),
    );
}

/// [`check_linear_gelu_refuses`] for flash attention and the fused linear cross-entropy.
pub fn check_attention_and_linear_ce_refuse<B: FusedOps>(device: &B::Device, dtype: DType) {
    let t4 = || tensor_as::<B, 4>(vec![0.5; 32], [1, 1, 2, 16], dtype, device);
    let err = cubecl_kernels::flash_attention(t4(), t4(), t4(), None, true).err();
    assert_refused("flash_attention", dtype, err);
    let h = tensor_as::<B, 2>(vec![0.5; 6], [2, 3], dtype, device);
    let w = tensor_as::<B, 2>(vec![0.25; 12], [3, 4], dtype, device);
    let t = Tensor::<B, 1, Int>::from_data(TensorData::new(vec![0i64, 3], [2]), device);
    let err = cubecl_kernels::linear_cross_entropy(h, w, t, -100).err();
    assert_refused("linear_cross_entropy", dtype, err);
}

/// `err` is `op`'s unsupported-dtype refusal of `dtype`, with a message that says so.
fn assert_refused(op: &'static str, dtype: DType, err: Option<cubecl_kernels::FusedError>) {
    assert_eq!(
        err,
        Some(cubecl_kernels::FusedError::UnsupportedDType { op, dtype })
    );
    let msg = err.map(|e| e.to_string()).unwrap_or_default();
    assert!(
        msg.contains("unsupported on this device"),
        "message should say the dtype is unsupported: {msg}"
    );
    eprintln!("{dtype:?} refused as expected: {msg}");
}

/// Fused linear cross-entropy loss and `(dh, dW)` through `Autodiff<B>` against the oracle;
/// about a quarter of the targets are `ignore_index` (all of them when `all_ignored`).
pub fn check_linear_ce<B: FusedOps>(
    device: &B::Device,
    rng: &mut Rng,
    shape: [usize; 3],
    all_ignored: bool,
    tol: f64,
) {
    check_linear_ce_dtype::<B>(device, rng, shape, all_ignored, DType::F32, tol);
}

/// [`check_linear_ce`] with `h`, `W`, the loss and the gradients in float type `dtype`.
pub fn check_linear_ce_dtype<B: FusedOps>(
    device: &B::Device,
    rng: &mut Rng,
    [n, hidden, vocab]: [usize; 3],
    all_ignored: bool,
    dtype: DType,
    tol: f64,
) {
    const IGNORE: i64 = -100;
    let (h, w) = (
        rounded(rng, n * hidden, 1.0, dtype),
        rounded(rng, hidden * vocab, 1.0, dtype),
    );
    let targets: Vec<i64> = (0..n)
        .map(|_| {
            if all_ignored || rng.below(4) == 0 {
                IGNORE
            } else {
                rng.below(vocab) as i64
            }
        })
        .collect();
    let (loss, dh, dw) = host::linear_cross_entropy(&h, &w, &targets, IGNORE, hidden, vocab);
    let label = format!(
        "linear_cross_entropy {dtype:?} n{n} hidden{hidden} vocab{vocab} all_ignored={all_ignored}"
    );
    let ht = tensor_as::<Autodiff<B>, 2>(h, [n, hidden], dtype, device).require_grad();
    let wt = tensor_as::<Autodiff<B>, 2>(w, [hidden, vocab], dtype, device).require_grad();
    let tt = Tensor::<Autodiff<B>, 1, Int>::from_data(TensorData::new(targets, [n]), device);
    let out = cubecl_kernels::linear_cross_entropy(ht.clone(), wt.clone(), tt, IGNORE)
        .expect("valid shapes");
    let grads = out.clone().sum().backward();
    // The loss is a single number: compare it with a plain relative error.
    let got = to_vec(out);
    assert_eq!(got.len(), 1, "{label}: loss is one element");
    assert_close(&format!("{label}: loss"), &got, &[loss], tol);
    // All ignored: the gradients are exactly zero, so a scale-relative check is meaningless;
    // demand zeros instead.
    let (gh, gw) = (
        to_vec(ht.grad(&grads).expect("dh")),
        to_vec(wt.grad(&grads).expect("dw")),
    );
    if all_ignored {
        assert!(
            gh.iter().chain(&gw).all(|x| *x == 0.0),
            "{label}: gradients must be zero"
        );
    } else {
        assert_close(&format!("{label}: dh"), &gh, &dh, tol);
        assert_close(&format!("{label}: dw"), &gw, &dw, tol);
    }
}

/// Mesa's CPU Vulkan adapter (lavapipe) with output poisoning on, after proving it computes;
/// panics with install instructions otherwise, so the wgpu kernel tests fail instead of
/// skipping on a machine without it.
#[cfg(feature = "wgpu")]
pub fn wgpu_cpu_device() -> burn::backend::wgpu::WgpuDevice {
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    cubecl_kernels::cube::set_poison_outputs(true);
    let probe = std::panic::catch_unwind(|| {
        let t =
            Tensor::<Wgpu, 1>::from_data(TensorData::new(vec![1.0f32, 2.0], [2]), &WgpuDevice::Cpu);
        t.sum().into_data().to_vec::<f32>()
    });
    match probe {
        Ok(Ok(v)) if v == [3.0] => WgpuDevice::Cpu,
        other => panic!(
            "no working CPU Vulkan adapter for the wgpu kernel tests ({other:?}); install Mesa's \
             software Vulkan driver: apt-get install mesa-vulkan-drivers libvulkan1"
        ),
    }
}
